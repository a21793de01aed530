"""Bytes to and from the disk: direct I/O, durable files with a CRC-32, the reader, the state file.

``direct`` (``O_DIRECT`` writes and reads through reused staging buffers; write options are
arguments, never process-wide flags) <- ``files`` (fsync, atomic replace, the checksumming
writer) <- ``reader`` (one pass per file, checksummed as it arrives; ``aio``, Linux native
asynchronous reads, keeps them in flight from one thread; ``device``, the copies of the pieces
onto a GPU as they arrive) <- ``statefile`` (one rank's flat state as a ``torch.save`` archive,
written and read through the above; ``archive`` finds its records, ``unpickle`` reads its
pickle, and each DCP item's, with the C unpickler where the state is plain). Nothing here knows
about step directories (that is ``format``) or about training state (that is ``state``).
"""
