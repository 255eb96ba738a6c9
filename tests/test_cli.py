"""The command line as a user meets it: help, clear errors without tracebacks, and a real (short) run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from remat.cli import main
from remat.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_finetune_help_lists_every_recipe_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["finetune", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for key in ("step_scheduler.max_steps", "distributed.activation_checkpointing", "loss_fn._target_",
                "model.output_hidden_states", "dataset.seq_length", "checkpoint.resume", "peft.r",
                "validation_dataset.split", "logging.memory"):
        assert key in out, key
    for raw in ("typing.", "Optional[", "Annotated[", "Gt(", "<class", "CheckpointPolicy("):
        assert raw not in out, raw  # types read as a person writes them
    assert "step_scheduler.val_every_steps  [int > 0 or null]  default null" in out
    assert "lr_scheduler.decay  [one of cosine | linear | constant]  default 'cosine'" in out


def test_config_error_is_one_message_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  preset: tiny-llama\nstep_scheduler:\n  max_step: 3\n")
    assert main(["finetune", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid recipe:")
    assert "step_scheduler.max_step: unknown key (did you mean 'step_scheduler.max_steps'" in err
    assert "Traceback" not in err


def test_print_config_fills_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["finetune", str(ROOT / "examples" / "quickstart.yaml"), "--print-config",
                 "--step_scheduler.max_steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 5" in out and "_target_: torch.optim.AdamW" in out


def test_print_config_reads_the_recipe_and_warns_of_a_data_file_not_there_which_a_run_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {preset: tiny-llama}\ndataset: {path: ./data/train.jsonl, seq_length: 32}\n")
    assert main(["finetune", str(recipe), "--print-config"]) == 0
    assert "path: ./data/train.jsonl" in capsys.readouterr().out
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "dataset.path: './data/train.jsonl' does not exist; expected a .jsonl file, a directory of them, a "
        "datasets.save_to_disk directory, or a Hugging Face Hub dataset id (org/name) (printed anyway: a run refuses "
        "it until it exists)"]
    assert main(["finetune", str(recipe), "--output_dir", str(tmp_path / "out")]) == 2
    assert "error: dataset.path: './data/train.jsonl' does not exist" in capsys.readouterr().err


def test_every_example_recipe_validates(capsys: pytest.CaptureFixture[str]) -> None:
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        assert main(["finetune", str(path), "--print-config"]) == 0, path


@pytest.mark.slow
def test_quickstart_runs_from_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "REMAT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "remat.cli", "finetune", str(ROOT / "examples" / "quickstart.yaml"),
         "--step_scheduler.max_steps", "2", "--step_scheduler.val_every_steps", "2",
         "--output_dir", str(tmp_path / "out"), "--tokenizer.vocab_size", "512"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^step 2 \| epoch 0 \| loss [\d.]+ \| grad_norm [\d.]+ \| lr [\d.e+-]+ \| mem [\d.]+ GiB \| "
                     r"tps \d+ \| num_label_tokens \d+$", proc.stdout, re.M), proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "step_2" / "model" / "config.json").is_file()
    assert proc.stdout.count("activation checkpointing: full") == 1  # the plan table, printed once
    assert proc.stdout.count(f"recipe: {ROOT / 'examples' / 'quickstart.yaml'}") == 1  # the file the run uses


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "remat finetune examples/quickstart.yaml" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_log_level_is_taken_before_or_after_the_command() -> None:
    from remat.cli import build_parser

    parser = build_parser()
    assert parser.parse_known_args(["report", "out", "--log-level", "DEBUG"])[0].log_level == "DEBUG"
    assert parser.parse_known_args(["--log-level", "ERROR", "report", "out"])[0].log_level == "ERROR"
    assert parser.parse_known_args(["report", "out"])[0].log_level == "INFO"


def test_a_distributed_strategy_in_one_process_is_said() -> None:
    from remat.commands.finetune import single_process_note

    note = single_process_note("fsdp2", 1, "fsdp2_quickstart")
    assert note is not None and "'fsdp2' but this is one process" in note
    assert "remat finetune fsdp2_quickstart --nproc-per-node N" in note
    assert single_process_note("fsdp2", 2, "r.yaml") is None and single_process_note("single", 1, "r.yaml") is None


def test_a_full_disk_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from remat.commands import report

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/.tmp-step_4-1/optimizer.pt")

    monkeypatch.setattr(report, "run", full)
    assert main(["report", "somewhere"]) == 1
    err = capsys.readouterr().err
    # `remat report` trains nothing: it does not speak of checkpoints (remat finetune does).
    assert err == "error: No space left on device (/ckpt/.tmp-step_4-1/optimizer.pt): nothing was changed\n"
    # A library's own wrapper of ENOSPC (safetensors, torch's zip writer) is one line too.

    def wrapped(*args: object) -> int:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(report, "run", wrapped)
    assert main(["report", "somewhere"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on the device holding") and len(err.strip().splitlines()) == 1


def test_other_os_errors_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.commands import report

    def bug(*args: object) -> int:
        raise FileNotFoundError(2, "No such file or directory", "x")

    monkeypatch.setattr(report, "run", bug)
    with pytest.raises(FileNotFoundError):
        main(["report", "somewhere"])


def test_restart_flag_sets_checkpoint_resume_restart(capsys: pytest.CaptureFixture[str]) -> None:
    quickstart = str(ROOT / "examples" / "quickstart.yaml")
    assert main(["finetune", quickstart, "--restart", "--print-config"]) == 0
    assert "resume: restart" in capsys.readouterr().out
    assert main(["finetune", quickstart, "--restart", "--checkpoint.resume", "never", "--print-config"]) == 2
    assert "error: --restart: conflicts with --checkpoint.resume never; give one of them" in capsys.readouterr().err


def test_restart_under_the_launcher_moves_checkpoints_once_and_workers_resume_auto(tmp_path: Path) -> None:
    from remat.commands.finetune import restart_before_launch
    from remat.recipes.loader import load_recipe

    cfg = load_recipe(ROOT / "examples" / "quickstart.yaml",
                      ["--output_dir", str(tmp_path), "--checkpoint.resume", "restart"])
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_3").mkdir(parents=True)
    (checkpoints / "step_3" / "COMPLETE.json").write_text("{}")
    (checkpoints / "latest").write_text("step_3\n")
    overrides = restart_before_launch(cfg, None, ["--checkpoint.resume", "restart"])
    assert overrides == ["--checkpoint.resume", "restart", "--checkpoint.resume", "auto"]
    (aside,) = [p for p in checkpoints.iterdir()]
    assert aside.name.startswith(".superseded-")
    assert sorted(p.name for p in aside.iterdir()) == ["latest", "step_3"]
    assert (aside / "latest").read_text() == "step_3\n"
    restart_before_launch(cfg, 1, [])  # another node's launcher moves nothing
    assert [p.name for p in checkpoints.iterdir()] == [aside.name]


@pytest.mark.parametrize("command", [
    ["profile", "quickstart", "--json", "{under}/p.json"],
    ["plan", "quickstart", "--png", "{under}/p.png"],
    ["estimate", "--preset", "tiny-llama", "--plot", "{under}/e.png"],
])
def test_an_output_under_a_regular_file_is_one_line_before_any_work(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    args = [part.format(under=tmp_path / "file") for part in command]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {args[-2]}: ") and "is under the regular file" in err and err.count("\n") == 1


def test_report_of_rows_without_memory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0, "tps": 3}\n')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {tmp_path / 'metrics.jsonl'}:1: a train row without mem_bytes, mem_source; allowed: rows "
                   "as remat finetune writes them (a file from another tool or an edited one?)\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "quickstart", "--budget", "-1GiB"], "error: --budget: got '-1GiB'; a budget is more than nothing; allowed:"),
    (["estimate", "--preset", "tiny-llama", "--fits", "-5GiB"], "error: --fits: got '-5GiB'; allowed: a number"),
])
def test_a_negative_size_is_answered_by_the_size_rules(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """argparse would take ``-1GiB`` for an option and answer "expected one argument"."""
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(message)


def test_a_report_png_that_is_a_directory_and_a_workdir_under_a_file_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each said before anything loads (they were tracebacks: IsADirectoryError, NotADirectoryError)."""
    (tmp_path / "run" / "report.png").mkdir(parents=True)
    assert main(["report", str(tmp_path / "run")]) == 2
    assert f"error: report: {str(tmp_path / 'run' / 'report.png')!r} is a directory; remat writes a regular file" in \
        capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["profile", "quickstart", "--workdir", str(tmp_path / "file" / "sub"), "--policies", "none"]) == 2
    assert f"error: --workdir: {str(tmp_path / 'file' / 'sub')!r} is under the regular file" in capsys.readouterr().err


def test_estimate_of_a_directory_without_a_config_says_so_and_an_unusable_cache_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["estimate", str(tmp_path / "empty")]) == 2
    assert f"error: model: the directory {str(tmp_path / 'empty')!r} has no config.json; allowed: a model directory" \
        in capsys.readouterr().err
    (tmp_path / "home").write_text("a file where the home directory belongs")
    monkeypatch.delenv("REMAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    from remat.data.tokenizer import builtin_tokenizer

    with pytest.raises(ConfigError, match=r"^the cache directory '.*home/.cache/remat' cannot be created \(.*\); "
                                          r"allowed: a writable place, set with REMAT_CACHE_DIR"):
        builtin_tokenizer(300)
