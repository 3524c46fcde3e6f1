"""One flag style for every command and a ``--help`` that reads as text.

absl names flags with underscores (``--save_predictions``) and argparse with hyphens
(``--gpus-per-node``); people type both, so each command rewrites the other spelling to its own
before parsing. ``--config.KEY=VALUE`` overrides and everything after ``--`` are left alone.
"""

from __future__ import annotations

import re
import sys

from absl import flags

HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "-?")
# Set by ``jaxrat SUBCOMMAND`` so a command's help names the way it was started.
PROG: list[str] = []


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i:]
    return argv, []


def _respell(arg: str, rename) -> str:
    if not arg.startswith("--") or arg == "--" or arg.startswith("--config."):
        return arg
    name, eq, value = arg[2:].partition("=")
    return f"--{rename(name)}{eq}{value}"


def absl_style(argv: list[str]) -> list[str]:
    """``argv`` with ``--save-predictions`` spelled ``--save_predictions`` and ``--no-per-image``
    spelled ``--noper_image`` (absl's negation); unknown names are left for absl to report."""
    def rename(name: str) -> str:
        name = name.replace("-", "_")
        if name.startswith("no_") and name not in flags.FLAGS and name[3:] in flags.FLAGS:
            return "no" + name[3:]
        return name
    head, tail = _split(argv)
    return [_respell(a, rename) for a in head] + tail


def argparse_style(argv: list[str]) -> list[str]:
    """``argv`` with ``--gpus_per_node`` spelled ``--gpus-per-node`` (argparse's style)."""
    head, tail = _split(argv)
    return [_respell(a, lambda n: n.replace("_", "-")) for a in head] + tail


def wants_help(argv: list[str]) -> bool:
    """Whether the command line (before any ``--``) asks for help."""
    return any(a in HELP_FLAGS for a in _split(argv)[0])


def plain(text: str) -> str:
    """A docstring as a person reads it: Sphinx roles and double backquotes removed."""
    text = re.sub(r":(?:mod|func|class|meth|attr|data):`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def prog(default: str) -> str:
    """The name the running command was started as (``jaxrat train`` or ``python -m jaxrat.main``)."""
    return PROG[0] if PROG else default


def absl_help(doc: str, module_file: str, default_prog: str, config_overrides: bool = True,
              extra: tuple[tuple[str, str], ...] = ()) -> str:
    """Help for an absl command: its docstring as text, then each of its flags with help and default
    (``extra``: (flag, help) pairs of options the command parses itself)."""
    lines = [plain(doc).strip(), "", f"usage: {prog(default_prog)} [options]", "", "options:"]
    for name, text in extra:
        lines += [f"  {name}", f"      {text}"]
    for flag in sorted(flags.FLAGS.get_key_flags_for_module(module_file), key=lambda f: f.name):
        if flag.name in ("help", "helpshort", "helpfull", "helpxml", "?"):
            continue
        value = "" if flag.boolean else " VALUE"
        default = "" if flag.default in (None, "") else f" (default: {flag.default})"
        required = " (required)" if flag.name in _required(module_file) else ""
        lines.append(f"  --{flag.name}{value}")
        lines.append(f"      {flag.help}{required}{default}")
    if config_overrides:
        lines.append("  --config.KEY=VALUE")
        lines.append("      override a field of the config, e.g. --config.data.batch_size=8")
    lines += ["  -h, --help", "      show this help and exit", "",
              "Flags may be written with hyphens or underscores (--save-predictions = --save_predictions)."]
    return "\n".join(lines) + "\n"


def _required(module_file: str) -> set[str]:
    # absl keeps required flags as validators; the message names the flag.
    names = set()
    for flag in flags.FLAGS.get_key_flags_for_module(module_file):
        for v in getattr(flag, "validators", []):
            if "required" in getattr(v, "message", "").lower() or "must have a value" in getattr(v, "message", ""):
                names.add(flag.name)
    return names


def print_help_and_exit(text: str) -> None:
    """Print ``text`` to stdout and exit 0 (absl's --help exits 1 with the markup)."""
    sys.stdout.write(text)
    sys.stdout.flush()
    sys.exit(0)


def run_argparse(main, argv: list[str]) -> int:
    """``main(argv)`` of an argparse command in its flag style, its ``--help`` as plain text."""
    argv = argparse_style(argv)
    if not wants_help(argv):
        return main(argv)
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            main(argv)
        except SystemExit:
            pass
    print_help_and_exit(plain(text.getvalue()))
    return 0


# Flags other tools spell differently, too far in letters from ours for difflib to find.
_MEANT = {"images": "input", "image": "input", "inputs": "input", "source": "input", "src": "input",
          "output": "out", "outdir": "out", "output_dir": "out", "dest": "out", "work_dir": "workdir",
          "run": "workdir", "run_dir": "workdir", "checkpoint": "step", "ckpt": "step"}


def flag_mistake(argv: list[str], module_file: str) -> str | None:
    """One sentence for an unknown flag or a missing required one in an absl command's ``argv``
    (absl says it in two lines with FATAL and exits 1), or None."""
    import difflib

    given = set()
    args = _split(argv)[0]
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg == "--" or arg.startswith("--config."):
            continue
        name, eq, value = arg[2:].partition("=")
        known = name in flags.FLAGS or (name.startswith("no") and name[2:] in flags.FLAGS)
        if not known:
            own = [f.name for f in flags.FLAGS.get_key_flags_for_module(module_file)]
            close = [_MEANT[name]] if _MEANT.get(name) in own else difflib.get_close_matches(name, own, n=1)
            hint = f"did you mean --{close[0]}?" if close else "--help lists the flags."
            return f"Unknown flag --{name}; {hint}"
        given.add(name)
        flag = flags.FLAGS[name] if name in flags.FLAGS else None
        if flag is None or flag.boolean or not (eq or i + 1 < len(args)):
            continue
        value = value if eq else args[i + 1]
        try:
            flag.parser.parse(value)
        except ValueError as e:  # absl says it as "FATAL Flags parsing error" and the parser's words
            kind = {"int": "an integer", "float": "a number"}.get(flag.flag_type())
            if kind:
                return f"--{name}={value} is not {kind}; pass {kind} (--help says what it takes)."
            return f"--{name}={value}: {str(e).rstrip('.')}; --help says what it takes."
    missing = sorted(_required(module_file) - given)
    if missing:
        return f"Pass --{missing[0]}: it is required (--help says what it takes)."
    return None
