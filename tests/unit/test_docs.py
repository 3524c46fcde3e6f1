"""The README and docs/**/*.md stay true: the commands, config overrides, config variants and links they
show exist, and the README's demo results are the ones the config files state.

What is checked, in fenced code blocks and inline code of README.md and docs/**/*.md:

- every ``python -m jaxrat.X`` names a module that exists, and ``python -m jaxrat.X --help`` exits 0
  (one subprocess per distinct module; ``--help`` stops before jax is imported, so each is quick);
- every ``configs/FILE.py:variant`` (also ``configs/FILE.py[:a|b|c]``) loads with jaxrat's config
  loader; upper-case variants (``:VARIANT``) are placeholders and skipped;
- every ``--config.KEY`` is a key of the config it is used with: the ``--config FILE[:variant]`` of
  the same line, else of the same code block; an override shown without a config file (inline
  code, or a block without ``--config``) must be a key of the base config or of some config file's
  default variant; an upper-case key (``--config.KEY=VALUE``) is a placeholder, and a span quoting
  jaxrat's own "Unknown config key" message is an example of the error, both skipped;
- an inline span that is just a config field (``data.batch_size``, ``model.rat.num_blocks=2``: a
  section of the base config, a dot, a name) must be a key of some config file, as above;
- every relative markdown link ``[text](path)`` points at a file or folder of the repository
  (anchors are not checked).

Demo results, one convention: a config file's docstring states what its demo reaches in one line
``Expected (demo): CLAIM`` (e.g. ``Expected (demo): eval Dice 0.99 after 400 steps, ~10 min on a 2-core
CPU``; another demo variant's: ``Expected (VARIANT): CLAIM``), and the README table row naming
``configs/FILE.py:demo`` (``:VARIANT``) quotes CLAIM word for word, so the
number is written in one place and copied in one other, and this test keeps the two the same.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import subprocess
import sys

import pytest

from jaxrat.config_schema import base_config, flatten, load_config
from jaxrat.config_schema.packaged import packaged_configs
from jaxrat.runtime.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_FILES = ["README.md", *sorted(os.path.relpath(p, REPO)
                                for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]

_FENCE = re.compile(r"^\s*```")
_INLINE = re.compile(r"`([^`\n]+)`")
_MODULE = re.compile(r"python -m (jaxrat(?:\.\w+)*)")
_CONFIG_SPEC = re.compile(r"(configs/\w+\.py)(?:(:\w*)|\[:([\w|]+)\])?")
_CONFIG_FLAG = re.compile(r"--config[= ]+(configs/\w+\.py(?::\w+)?)")
_OVERRIDE = re.compile(r"--config\.([A-Za-z_][\w.]*\w)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FILE_NAME = re.compile(r"\.(py|md|json|jsonl|csv|png|txt|yaml|sh|ipynb)$")
_EXPECTED = re.compile(r"^\s*Expected \((\w+)\): (.+?)\s*$", re.M)


@dataclasses.dataclass(frozen=True)
class Snippet:
    """One line of a fenced block (continuations joined) or one inline code span, with where it is."""

    where: str  # FILE:LINE
    text: str
    block_config: str | None  # the --config FILE[:variant] of the enclosing code block, if any


def snippets(markdown: str, name: str) -> list[Snippet]:
    """The code of a markdown text: each line of its fenced blocks and each inline code span."""
    out: list[Snippet] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            body = []
            i += 1
            while i < len(lines) and not _FENCE.match(lines[i]):
                body.append((i + 1, lines[i]))
                i += 1
            block = "\n".join(text for _, text in body)
            found = _CONFIG_FLAG.findall(block)
            block_config = found[0] if len(set(found)) == 1 else None
            pending, first = "", None
            for number, text in body:
                first = first or number
                if text.rstrip().endswith("\\"):
                    pending += text.rstrip()[:-1] + " "
                    continue
                out.append(Snippet(f"{name}:{first}", pending + text, block_config))
                pending, first = "", None
        else:
            for m in _INLINE.finditer(lines[i]):
                out.append(Snippet(f"{name}:{i + 1}", m.group(1), None))
        i += 1
    return out


def config_specs(text: str) -> list[str]:
    """``configs/FILE.py[:variant]`` named in ``text``, alternatives expanded, placeholders dropped."""
    specs = []
    for path, variant, alternatives in _CONFIG_SPEC.findall(text):
        if alternatives:
            specs += [f"{path}:{v}" for v in alternatives.split("|") if not v.isupper()]
        elif variant and variant[1:] and not variant[1:].isupper():
            specs.append(path + variant)
        else:
            specs.append(path)
    return specs


@functools.cache
def _keys(spec: str | None) -> frozenset[str]:
    if spec is None:
        return frozenset(flatten(base_config()))
    return frozenset(flatten(load_config(os.path.join(REPO, spec))))


@functools.cache
def _any_config_keys() -> frozenset[str]:
    keys = set(_keys(None))
    for name in packaged_configs():
        keys |= _keys(f"configs/{name}.py")
    return frozenset(keys)


def _is_key(key: str, keys: frozenset[str]) -> bool:
    # `--config.noFLAG` is how absl spells a false boolean.
    return key in keys or (key.startswith("no") and key[2:] in keys)


@functools.cache
def _bare_field() -> re.Pattern:
    sections = sorted(k for k, v in base_config().items() if hasattr(v, "items"))
    return re.compile(r"^((?:%s)\.[A-Za-z_][\w.]*\w)(?:=\S*)?$" % "|".join(sections))


def check_markdown(markdown: str, name: str) -> tuple[list[str], set[str]]:
    """The problems of one markdown text (config specs, overrides, fields, links), and the modules it runs."""
    problems: list[str] = []
    modules: set[str] = set()
    for s in snippets(markdown, name):
        modules.update(_MODULE.findall(s.text))
        field = _bare_field().match(s.text.strip())
        if field and not _FILE_NAME.search(field.group(1)) and not _is_key(field.group(1), _any_config_keys()):
            problems.append(f"{s.where}: {field.group(1)} is not a key of any config file")
        for spec in config_specs(s.text):
            try:
                _keys(spec)
            except ConfigError as e:
                problems.append(f"{s.where}: {spec}: {e}")
        overrides = [k for k in _OVERRIDE.findall(s.text) if not k.isupper()]
        if not overrides or "Unknown config key" in s.text:
            continue
        line_configs = _CONFIG_FLAG.findall(s.text)
        spec = line_configs[0] if line_configs else s.block_config
        if spec is not None and any(p.startswith(f"{spec}: ") for p in problems):
            continue  # the config itself is already reported
        try:
            keys = _keys(spec) | _keys(None) if spec else _any_config_keys()
        except ConfigError:
            continue
        for key in overrides:
            if not _is_key(key, keys):
                problems.append(f"{s.where}: --config.{key} is not a key of {spec or 'any config file'}")
    for m in _LINK.finditer(markdown):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue  # an anchor on the same page, or a URL
        base = os.path.dirname(os.path.join(REPO, name))
        if not os.path.exists(os.path.normpath(os.path.join(base, target))):
            line = markdown.count("\n", 0, m.start()) + 1
            problems.append(f"{name}:{line}: link {m.group(1)} points at nothing")
    return problems, modules


def _read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


def _modules_shown() -> set[str]:
    return {m for name in DOC_FILES for s in snippets(_read(name), name) for m in _MODULE.findall(s.text)}


@pytest.mark.parametrize("name", DOC_FILES)
def test_configs_overrides_and_links_shown_exist(name):
    problems, _ = check_markdown(_read(name), name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", sorted(_modules_shown()))
def test_every_command_shown_runs_its_help(module):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    # argparse exits 0 after its usage; absl prints its flags and exits 1 ("Try --helpfull ...").
    absl_help = proc.returncode == 1 and "Try --helpfull" in proc.stdout
    assert proc.returncode == 0 or absl_help, f"--help exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower() or "flags" in proc.stdout.lower(), proc.stdout[:500]


def test_readme_demo_results_are_the_configs_own():
    readme = _read("README.md")
    rows = [line for line in readme.splitlines() if line.startswith("|")]
    claimed = 0
    for path in (os.path.join(REPO, "configs", f"{name}.py") for name in packaged_configs()):
        expected = dict(_EXPECTED.findall(_read(os.path.relpath(path, REPO))))
        for variant in sorted({"demo", *expected}):
            demo = f"configs/{os.path.basename(path)}:{variant}"
            named = [row for row in rows if demo in row]
            if not named:
                continue
            assert variant in expected, (
                f"README's table names {demo} but {os.path.basename(path)} states no 'Expected ({variant}): ...'")
            assert any(expected[variant] in row for row in named), (
                f"README's row for {demo} does not quote its config's 'Expected ({variant}): {expected[variant]}'")
            claimed += variant == "demo"
    assert claimed >= 3, "README's table should name the demos of isic, classification and coco"


BAD_README = """\
# A copy with mistakes

```bash
python -m jaxrat.main --config configs/isic.py:demo --workdir runs/x --config.data.batch_size=8 \\
    --config.data.no_such_key=1
python -m jaxrat.main --config configs/isic.py:nosuchvariant --workdir runs/y
```

Inline: `--config configs/coco.py:demo --config.model.rat.remats=blocks`, `configs/isic.py[:demo|missing]`,
and `--config.train.not_a_field=3`; the field `data.batch_size` and the field `model.rat.remats="blocks"`,
and the file `jaxrat/checkpointing/init_from.py`.
Read [the guide](docs/no_such_page.md) and [data](docs/data.md#anchor).
"""


def test_the_checker_names_each_bad_item():
    problems, modules = check_markdown(BAD_README, "README.md")
    text = "\n".join(problems)
    assert modules == {"jaxrat.main"}
    assert "README.md:4: --config.data.no_such_key is not a key of configs/isic.py:demo" in text
    assert "--config.data.batch_size" not in text
    assert "README.md:6: configs/isic.py:nosuchvariant:" in text
    assert "--config.model.rat.remats is not a key of configs/coco.py:demo" in text
    assert "configs/isic.py:missing:" in text and "configs/isic.py:demo:" not in text
    assert "--config.train.not_a_field is not a key of any config file" in text
    assert "link docs/no_such_page.md points at nothing" in text and "docs/data.md#anchor" not in text
    assert "README.md:10: model.rat.remats is not a key of any config file" in text
    assert "data.batch_size is" not in text and "init_from" not in text
    assert len(problems) == 7, text
