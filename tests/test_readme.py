"""The README's example and commands, read from the README itself and run (the commands through the real CLI).

A command is taken verbatim (continuation lines joined) and made small by flags appended after
it (later flags win), so a flag the README shows that the CLI no longer accepts fails here.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch
from conftest import REPO, checkpoint_dir, read_metrics, run_cli

README = (REPO / "README.md").read_text()

#: Appended to the README's quick MNIST variant: a few updates on a few images.
TOY = ["--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--data.limit_val", "8",
       "--data.batch_size", "4", "--trainer.enable_progress_bar", "false", "--model.predict_num_samples", "2"]


def cli_commands(text: str) -> list[list[str]]:
    """Every ``[uv run] python cli.py ...`` in ``text``'s bash blocks and inline code, as the
    argument list after ``cli.py`` (continuation lines joined, comments dropped)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]*python cli\.py [^`\n]*)`", text)
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if "cli.py" in words and words[words.index("cli.py") - 1] == "python":
            commands.append(words[words.index("cli.py") + 1:])
    return commands


def readme_commands() -> list[list[str]]:
    return cli_commands(README)


def the_command(*fragments: str) -> list[str]:
    found = [c for c in readme_commands() if all(f in " ".join(c) for f in fragments)]
    assert len(found) == 1, f"expected one README command with {fragments}, found {found}"
    return found[0]


def readme_example() -> str:
    """The one Python block of the README's "Use" section, its first screen."""
    section = README[README.index("\n## Use\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"the README's Use section should hold one Python example, found {len(blocks)}"
    return blocks[0]


def test_the_readme_example_runs_and_stays_short():
    """The first-screen example runs as printed (its own assert: the RNN step equals the parallel
    forward) and gives the shapes its comments state, in at most 15 lines of code."""
    code = readme_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 15
    namespace: dict = {}
    exec(compile(code, "README.md (Use)", "exec"), namespace)
    assert namespace["out"].shape == (2, 4, 100, 32) and namespace["y"].shape == (2, 100, 64)
    assert torch.isfinite(namespace["y"]).all()

@pytest.mark.slow
def test_quick_mnist_variant_then_its_saved_config_resumes_tests_and_predicts(tmp_path):
    """The README's quick MNIST variant, then the three commands that go on from its saved config."""
    quick = the_command("fit", "--config mnist_linear.yaml", "--model.n_layers 2")
    code, _, err = run_cli([*quick, *TOY], cwd=tmp_path)
    assert code == 0, err[-3000:]
    root = tmp_path / "logs" / "mnist_linear"
    saved = root / "version_0" / "config.yaml"
    assert saved.is_file()

    resume = the_command("fit", "version_0/config.yaml", "--ckpt_path last")
    code, _, err = run_cli([*resume, "--trainer.max_steps", "6"], cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert torch.load(checkpoint_dir(root) / "last.ckpt", weights_only=False)["global_step"] == 6
    assert not (root / "version_1" / "checkpoints").exists()  # the resumed run kept its own directory

    test = the_command("test", "version_0/config.yaml", "--ckpt_path best")
    code, _, err = run_cli([*test, "--data.limit_test", "8"], cwd=tmp_path)  # 8 test images, not 10,000
    assert code == 0, err[-3000:]
    tested = [r for r in read_metrics(root / "version_2") if "test/bits_per_dim" in r]
    assert tested and 0 < tested[0]["test/bits_per_dim"] < 8

    predict = the_command("predict", "version_0/config.yaml", "--ckpt_path best")
    code, out, err = run_cli([*predict, "--model.predict_num_samples", "2"], cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert list((root / "version_3" / "predictions").glob("*.png"))


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def data_and_model_settings(command: list[str]) -> tuple[str, ...]:
    """``command`` less its ``--trainer.*`` and ``--ckpt_path`` flags (each with its value)."""
    kept, skip_value = [], False
    for word in command:
        if skip_value:
            skip_value = False
        elif word.startswith(("--trainer.", "--ckpt_path")):
            skip_value = "=" not in word
        else:
            kept.append(word)
    return tuple(kept)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_cli_command_of_the_docs_parses(doc, tmp_path):
    """Each ``cli.py`` command the README and docs/ show is accepted by the real CLI
    (``--print_config`` for the LightningCLI subcommands; ``plugins`` and help commands run as
    shown). Skipped: synopsis
    lines with placeholders, and commands that read a run's saved config (the README's run in
    the test above); a command the doc shows twice is checked once."""
    commands = cli_commands(doc.read_text())
    assert commands or doc.name not in ("README.md", "cli.md")
    checked, updated = set(), set()
    for command in commands:
        text = " ".join(command)
        if text in checked or any(word.startswith("logs/") for word in command) \
                or re.search(r"\bNAME\b|\{fit|\[--|\.\.\.|SUBCOMMAND", text):
            continue
        checked.add(text)
        if command[0] == "plugins" or any(word in ("-h", "--help") or word.endswith(".help") for word in command):
            code, _, err = run_cli(command, cwd=tmp_path)  # help prints and exits: nothing to add
        else:
            code, _, err = run_cli([*command, "--print_config"], cwd=tmp_path)
        assert code == 0, f"{doc.name}: {text}: {err[-2000:]}"
        if command[0] == "fit" and any(word.startswith("copy_") for word in command) \
                and data_and_model_settings(command) not in updated:
            # --print_config builds no class: one update of a tiny model checks what the data and
            # model make of the command's own data settings (e.g. lengths the config contradicts):
            # once for each config with its --data and --model flags, whatever its trainer flags
            updated.add(data_and_model_settings(command))
            tiny = ["--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.devices=1",
                    "--trainer.precision=32-true", "--model.d_model=16", "--model.n_heads=2", "--model.n_layers=1"]
            code, _, err = run_cli([*command, *tiny], cwd=tmp_path)
            assert code == 0, f"{doc.name}: {text} (one tiny update): {err[-2000:]}"
