"""Every entry point under experiments/ parses its command line through experiments/cli.py:
a misspelt field or flag fails in one line (exit 2, the closest valid names, no
traceback) before JAX compiles anything, ``--list_fields`` lists its fields and flags,
``--config=gqa`` names a shipped config, and output into a closed pipe ends quietly."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENTRY_POINTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                      if 'if __name__ == "__main__":' in p.read_text())
CONFIG_FILE_ENTRY_POINTS = ("ablate", "decode", "export", "longeval", "ppl", "serve",
                            "speculative", "uptrain")


def entry(module, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_every_entry_point_runs_through_cli():
    assert len(ENTRY_POINTS) >= 11, ENTRY_POINTS
    for name in ENTRY_POINTS:
        text = (ROOT / "experiments" / f"{name}.py").read_text()
        main_block = text.split('if __name__ == "__main__":')[1]
        assert "cli.run(main" in main_block and "app.run" not in main_block, name
        assert "config_flags.DEFINE" not in text, name  # cli.DEFINE_config_* instead


# (arguments with one misspelt field or flag, the message's start)
MISSPELT = {
    "ablate": ("--config.model.window_sise=3", "unknown field --config.model.window_sise; "
               "did you mean --config.model.window_size?"),
    "batch": ("--max_bach=3", "unknown flag --max_bach; did you mean --max_batch?"),
    "bench": ("--repeat=3", "unknown flag --repeat; did you mean --repeats?"),
    "compare": ("--eval.num_token=3", "unknown field --eval.num_token; did you mean "
                "--eval.num_tokens?"),
    "costs": ("--contxts=512", "unknown flag --contxts; did you mean --contexts?"),
    "decode": ("--config.sampling.temprature=1", "unknown field "
               "--config.sampling.temprature; did you mean --config.sampling.temperature?"),
    "export": ("--outt=/tmp/x", "unknown flag --outt; did you mean --out?"),
    "longeval": ("--sample=3", "unknown flag --sample; did you mean --samples?"),
    "ppl": ("--eval.corpus_=x", "unknown field --eval.corpus_; did you mean --eval.corpus?"),
    "prefill": ("--impl=native", "unknown flag --impl; did you mean --impls?"),
    "serve": ("--config.model.window_sise=3", "unknown field --config.model.window_sise; "
              "did you mean --config.model.window_size?"),
    "shard": ("--layer=2", "unknown flag --layer; did you mean --layers?"),
    "speculative": ("--config.speculative.drafte=ngram", "unknown field "
                    "--config.speculative.drafte; did you mean --config.speculative.drafter?"),
    "uptrain": ("--train.step=3", "unknown field --train.step; did you mean --train.steps?"),
}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_a_misspelt_field_or_flag_fails_in_one_line(module):
    arg, message = MISSPELT[module]
    proc = entry(module, arg)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: " + message), proc.stderr
    assert lines[1] == f"usage: python -m experiments.{module} --help | --list_fields"


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_list_fields_lists_the_fields_and_the_flags(module):
    args = ["--config=gqa"] if module in CONFIG_FILE_ENTRY_POINTS else []
    proc = entry(module, *args, "--list_fields")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"\nflags of python -m experiments.{module}:\n" in "\n" + proc.stdout
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("  --")]
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)) and "--list_fields" not in names
    own = [n for n in names if "." not in n]
    assert own and all(len(r) >= 3 for r in rows)
    if module in CONFIG_FILE_ENTRY_POINTS:  # --config=gqa: configs/gqa.py's values
        assert re.search(r"values from \S*configs/gqa\.py", proc.stdout), proc.stdout[:500]
        assert "--config.model.num_kv_heads" in names


def test_flag_values_and_negated_booleans_still_parse():
    """Valid plain flags pass the check (the run then stops at its own validation)."""
    proc = entry("shard", "--noquick_unknown")
    assert proc.returncode == 2 and "unknown flag --noquick_unknown" in proc.stderr
    # known flags (and one absl's --undefok excuses): shard's own check refuses -1
    proc = entry("shard", "--undefok=foo", "--foo=3", "--layers=-1")
    assert "unknown flag" not in proc.stderr
    assert "--layers=-1; allowed: 0 (all layers)" in proc.stderr
    proc = entry("bench", "--noquick", "--repeats", "3", "--list_fields")
    assert proc.returncode == 0 and "flags of python -m experiments.bench" in proc.stdout, \
        proc.stderr[-2000:]


@pytest.mark.parametrize("module", ["decode", "serve", "costs"])
def test_output_into_a_closed_pipe_ends_quietly(module):
    """``python -m experiments.decode --list_fields | head``: the reader goes before the
    listing is written (used to end in a BrokenPipeError traceback, exit 1)."""
    proc = subprocess.Popen([sys.executable, "-m", f"experiments.{module}", "--list_fields"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # before the child has imported anything: every write fails
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 141, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err
