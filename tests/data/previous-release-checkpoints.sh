#!/usr/bin/env bash
# How tests/data/previous-release-checkpoints/ was made: the tiny trainer of tests/ckpt_helpers.py
# at e0fc34a (the release before #21's load path: reads straight into the live tensors, the
# streaming DCP reader, the undo of the only checkpoint), 7 steps, a checkpoint at step 7:
#   one/  one process (a state file, rank-00000.pt);
#   two/  two DDP ranks over gloo (DCP files and one state file per rank);
# and each rank's model and optimizer state dicts at step 7 as torch.save wrote them
# (NAME.expected.rankR), what a load must give back exactly.
set -ex
git worktree add --detach /tmp/oldrel e0fc34a
cd /tmp/oldrel
python3 - <<'PY'
import sys
sys.path[:0] = ["/tmp/oldrel/tests", "/tmp/oldrel"]
import ckpt_helpers as h
h.run_ranks(["train", "--root", "/tmp/xver/one", "--steps", "7", "--stop-at", "7", "--out", "/tmp/xver/one.out"], 1)
h.run_ranks(["train", "--root", "/tmp/xver/two", "--steps", "7", "--stop-at", "7", "--out", "/tmp/xver/two.out"], 2)
PY
D=/work/main/tests/data/previous-release-checkpoints
mkdir -p $D && cp -r /tmp/xver/one /tmp/xver/two $D/
for f in one.out.rank0 two.out.rank0 two.out.rank1; do cp /tmp/xver/$f $D/${f/.out./.expected.}; done
