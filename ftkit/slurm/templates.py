"""sbatch templates: find them, list their settings, render them.

The templates are plain bash files in the repository's top-level ``sbatch_templates/``
directory (``single.sbatch``, ``srun.sbatch``, ``torchrun.sbatch``). A placeholder is
``{{name}}``; bash's own ``${name}`` and ``$((...))`` pass through untouched. The renderer
is deliberately tiny:

* every placeholder must have a value (given, or a default from :data:`PARAMS`), and every
  given value must name a placeholder of that template; both mistakes raise
  :class:`~ftkit.errors.ConfigError` listing the valid names;
* on an ``#SBATCH`` line an empty value drops the line (optional options such as
  ``partition``) and a value of several lines repeats the line once per value line
  (``extra_sbatch``);
* values are inserted verbatim: they are bash (``jobdir`` may say ``$SLURM_SUBMIT_DIR``).

Where the templates are looked for, first hit wins: ``$FTKIT_TEMPLATES_DIR``, then
``sbatch_templates/`` next to the ``ftkit`` package (a checkout or an editable install),
then ``<prefix>/share/ftkit/sbatch_templates`` (a wheel that ships them as data files).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = [
    "PARAMS",
    "TEMPLATE_DEFAULTS",
    "Param",
    "list_templates",
    "render",
    "render_text",
    "template_description",
    "template_params",
    "templates_dir",
]

ENV_DIR = "FTKIT_TEMPLATES_DIR"
SUFFIX = ".sbatch"

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_BRACES = re.compile(r"\{\{|\}\}")


def _int_at_least(low: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if not re.fullmatch(r"\d+", value.strip()) or int(value) < low:
            return f"a whole number >= {low}"
        return None

    return check


def _time_limit(value: str) -> str | None:
    # sbatch accepts M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (and UNLIMITED/INFINITE).
    if re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE", value.strip(), re.IGNORECASE):
        return None
    return "a SLURM time limit such as 90 (minutes), 04:00:00 or 1-12:00:00"


def time_limit_seconds(value: str) -> int | None:
    """Seconds of a SLURM time limit (``90`` minutes, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``); None for ``UNLIMITED``/``INFINITE`` or a value it does not read."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if m is None:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, sec = [*parts, 0, 0][:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60  # minutes
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # M:S
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _one_line(value: str) -> str | None:
    return "a single line" if "\n" in value else None


def _anything(value: str) -> str | None:
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """One template setting: its default and what it means."""

    default: str
    """Value used when none is given (may be empty: the ``#SBATCH`` line is left out)."""

    help: str
    """One line for ``ftkit template --list``."""

    check: Callable[[str], str | None] = _one_line
    """Returns what a valid value looks like when ``value`` is not one, else None."""


#: Every setting a shipped template uses, with its default. A template in
#: ``$FTKIT_TEMPLATES_DIR`` may use other names; those have no default and must be given.
PARAMS: dict[str, Param] = {
    "job_name": Param(default="ftkit", help="#SBATCH --job-name (also names the default jobdir)"),
    "jobdir": Param(
        default="$SLURM_SUBMIT_DIR/ftkit-jobs/$SLURM_JOB_NAME${SLURM_ARRAY_TASK_ID:+-$SLURM_ARRAY_TASK_ID}",
        help="the ftkit job directory (bash; the same across requeues, one per array task)",
    ),
    "time": Param(default="01:00:00", help="#SBATCH --time, the time limit", check=_time_limit),
    "lead_time": Param(
        default="180",
        help="seconds before the time limit that SIGUSR1 arrives (> one step + one save + 60 s)",
        check=_int_at_least(1),
    ),
    "partition": Param(default="", help="#SBATCH --partition; empty: the cluster's default"),
    "gpus_per_node": Param(default="", help="#SBATCH --gpus-per-node; empty: no GPUs requested"),
    "nodes": Param(default="1", help="#SBATCH --nodes", check=_int_at_least(1)),
    "ntasks_per_node": Param(
        default="2", help="#SBATCH --ntasks-per-node: training processes per node", check=_int_at_least(1)
    ),
    "nproc_per_node": Param(
        default="2", help="torchrun --nproc-per-node: training processes per node", check=_int_at_least(1)
    ),
    "cpus_per_task": Param(
        default="1", help="#SBATCH --cpus-per-task (torchrun: shared by its workers)", check=_int_at_least(1)
    ),
    "output": Param(default="%x-%j.out", help="#SBATCH --output (stdout of every run, appended)"),
    "error": Param(default="%x-%j.err", help="#SBATCH --error (stderr of every run, appended)"),
    "python": Param(default="python3", help="the Python that has ftkit installed"),
    "command": Param(
        default='"$PYTHON" -m ftkit demo --jobdir "$JOBDIR"',
        help="the training command (bash; $PYTHON and $JOBDIR are set)",
    ),
    "master_port": Param(
        default="$((20000 + SLURM_JOB_ID % 20000))",
        help="rendezvous port (bash; the default derives it from the job id)",
    ),
    "max_requeues": Param(
        default="20", help="ftkit requeue --max-requeues: cap on requeues", check=_int_at_least(0)
    ),
    "extra_sbatch": Param(
        default="", help="more #SBATCH options, one per line (e.g. --mem=16G)", check=_anything
    ),
}

#: Per-template defaults that differ from :data:`PARAMS`.
TEMPLATE_DEFAULTS: dict[str, dict[str, str]] = {
    "torchrun": {
        "nodes": "2",
        "cpus_per_task": "2",
        "command": '-m ftkit demo --jobdir "$JOBDIR"',
    },
}


# --------------------------------------------------------------------------------------
# finding templates


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get(ENV_DIR)
    if env:
        out.append(Path(env).expanduser())
    out.append(Path(__file__).resolve().parents[2] / "sbatch_templates")
    out.append(Path(sys.prefix) / "share" / "ftkit" / "sbatch_templates")
    return out


def templates_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding the ``*.sbatch`` templates; ConfigError naming where it looked."""
    if directory is not None:
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(f"templates directory {path} does not exist")
        return path
    searched = _candidates()
    if os.environ.get(ENV_DIR) and not searched[0].is_dir():
        raise ConfigError(f"{ENV_DIR}={searched[0]} is not a directory; point it at the sbatch_templates/ folder")
    for path in searched:
        if path.is_dir():
            return path
    raise ConfigError(
        "no sbatch templates found; looked in "
        + ", ".join(str(p) for p in searched)
        + f". Set {ENV_DIR} to the sbatch_templates/ directory of an ftkit checkout"
    )


def list_templates(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Names of the available templates (file names without ``.sbatch``), sorted."""
    root = templates_dir(directory)
    return sorted(p.name[: -len(SUFFIX)] for p in root.glob(f"*{SUFFIX}") if p.is_file())


def _read(name: str, directory: str | os.PathLike[str] | None) -> str:
    available = list_templates(directory)
    if name not in available:
        root = templates_dir(directory)
        raise ConfigError(
            f"template {name!r}: no {name}{SUFFIX} in {root}; available: "
            + (", ".join(available) or "none")
        )
    return (templates_dir(directory) / f"{name}{SUFFIX}").read_text(encoding="utf-8")


def template_description(name: str, directory: str | os.PathLike[str] | None = None) -> str:
    """The template's summary: the text after ``ftkit template: NAME --`` on its second line."""
    for line in _read(name, directory).splitlines()[:5]:
        m = re.match(r"#\s*ftkit template:\s*\S+\s*--\s*(.*)", line)
        if m:
            return m.group(1).strip()
    return ""


def _placeholders(text: str) -> list[str]:
    return list(dict.fromkeys(_PLACEHOLDER.findall(text)))


def template_params(name: str, directory: str | os.PathLike[str] | None = None) -> dict[str, str | None]:
    """The settings a template uses, in order of appearance, with defaults (None: required)."""
    overrides = TEMPLATE_DEFAULTS.get(name, {})
    out: dict[str, str | None] = {}
    for key in _placeholders(_read(name, directory)):
        if key in overrides:
            out[key] = overrides[key]
        else:
            out[key] = PARAMS[key].default if key in PARAMS else None
    return out


# --------------------------------------------------------------------------------------
# rendering


def render_text(
    text: str,
    values: Mapping[str, str],
    *,
    defaults: Mapping[str, str | None] | None = None,
    name: str = "template",
) -> str:
    """Fill ``{{key}}`` placeholders of ``text``; see the module docstring for the rules."""
    keys = _placeholders(text)
    valid = ", ".join(sorted(keys)) or "none"
    for key in values:
        if key not in keys:
            raise ConfigError(f"{name}: unknown setting {key!r}; valid settings: {valid}")
    defaults = defaults or {}
    resolved: dict[str, str] = {}
    for key in keys:
        value = values.get(key, defaults.get(key))
        if value is None:
            raise ConfigError(f"{name}: setting {key!r} has no value and no default; "
                              f"give it with --set {key}=VALUE (valid settings: {valid})")
        value = str(value)
        param = PARAMS.get(key)
        problem = param.check(value) if param is not None else _one_line(value)
        if problem:
            raise ConfigError(f"{name}: setting {key}={value!r} is not valid; expected {problem}")
        resolved[key] = value.strip()
    if "time" in resolved and "lead_time" in resolved:
        limit = time_limit_seconds(resolved["time"])
        if limit is not None and int(resolved["lead_time"]) >= limit:
            raise ConfigError(
                f"{name}: setting lead_time={resolved['lead_time']} is not shorter than time={resolved['time']} "
                f"({limit} s): SIGUSR1 would come at once and every run would save, exit and requeue "
                f"right after it started; give a lead_time of one step + one save + 60 s, well under the limit")
    out: list[str] = []
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        stripped_line = _PLACEHOLDER.sub("", line)
        if _BRACES.search(stripped_line):
            raise ConfigError(f"{name}, line {lineno}: malformed placeholder in {line.strip()!r}; "
                              "write {{name}} with letters, digits and underscores")
        used = _PLACEHOLDER.findall(line)
        if used and line.startswith("#SBATCH"):
            if any(not resolved[k].strip() for k in used):
                continue  # optional option left empty: leave the line out
            if len(used) == 1 and "\n" in resolved[used[0]]:
                m = _PLACEHOLDER.search(line)
                assert m is not None
                for part in resolved[used[0]].splitlines():
                    option = re.sub(r"^#SBATCH\s+", "", part.strip())
                    if option:
                        out.append(line[: m.start()] + option + line[m.end() :])
                continue
        out.append(_PLACEHOLDER.sub(lambda m: resolved[m.group(1)], line))
    return "".join(out)


def render(
    name: str,
    values: Mapping[str, str] | None = None,
    *,
    directory: str | os.PathLike[str] | None = None,
) -> str:
    """Render template ``name`` with ``values`` over its defaults; ConfigError on bad names."""
    text = _read(name, directory)
    values = dict(values or {})
    if "extra_sbatch" in values:  # one option per line; a leading "#SBATCH" is optional
        values["extra_sbatch"] = "\n".join(
            re.sub(r"^#SBATCH\s+", "", ln.strip()) for ln in values["extra_sbatch"].splitlines()
        ).strip()
    return render_text(text, values, defaults=template_params(name, directory), name=f"template {name!r}")
