"""startup: `ardiff --help` and `ardiff inspect-capacity` on the 14B config, as whole processes.

Baseline: `python -c pass` with the same interpreter, measured alternately with
the two commands (``turn_order`` every repetition). Target: both commands
under 1 s wall on this machine in every timed run, the slowest included (the
one absolute figure of the suite, because the issue asks for it); the ratio of
the medians to a bare interpreter start is reported. The warmup's checkpoint is
built in a temporary cache (``private_cache``) unless ARDIFF_CACHE_DIR names one.

Also reported, in the same rotation: the end of a process that imported torch.
`ardiff warmup causal-world-tiny` as a whole process, against the same command
ended by the interpreter's own exit (``sys.exit``, which tears down every
module) instead of ardiff's (``ardiff_cli.app.main``: threads joined, atexit
handlers run, streams flushed, then ``os._exit``): ``exit_ratio``.

The command is the installed ``ardiff`` console script when it sits next to
this interpreter, else ``python -m ardiff_cli``. The repository root is put on
``PYTHONPATH`` so the built-in pipelines import from a checkout whatever the
state of its editable install.

    python -m benchmarks.bench_startup            # 10 repetitions
    python -m benchmarks.bench_startup --quick    # 2 repetitions
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT, cli, private_cache, turn_order

CONFIG_14B = "dreamzero-14b"
# `ardiff ARGS` ended by sys.exit, as it was before main() skipped the interpreter's teardown
# app.main() ends through app._end_process: replaced (it must exist, or the comparison would time ardiff twice)
INTERPRETER_EXIT = ("import sys; import ardiff_cli.app as app; assert callable(app._end_process); "
                    "app._end_process = sys.exit; "
                    "sys.argv = ['ardiff', *sys.argv[1:]]; app.main()")
WARMUP = ("warmup", "causal-world-tiny", "--device", "cpu", "--format", "json")
TARGET_S = 1.0
FULL_REPETITIONS = 10  # one period of turn_order over the 5 commands: each goes before each other half the time


def ardiff_command() -> list[str]:
    script = Path(sys.executable).parent / "ardiff"
    return [str(script)] if script.is_file() and os.access(script, os.X_OK) else [sys.executable, "-m", "ardiff_cli"]


def _wall(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    return time.perf_counter() - start


def run(quick: bool = False) -> dict:
    with private_cache():  # the warmup builds its checkpoint: never into the user's cache
        return _run(2 if quick else FULL_REPETITIONS, quick)


def _run(repeats: int, quick: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               NO_COLOR="1")
    ardiff = ardiff_command()
    commands = {
        "python": [sys.executable, "-c", "pass"],
        "help": [*ardiff, "--help"],
        # --available fixes the plan (no device probe), so the figure does not depend on this machine's memory
        "inspect": [*ardiff, "inspect-capacity", CONFIG_14B, "--available", "80GiB"],
        "warmup": [*ardiff, *WARMUP],
        "warmup_interpreter_exit": [sys.executable, "-c", INTERPRETER_EXIT, *WARMUP],
    }
    for argv in commands.values():  # warm the file cache once; a failing command raises here
        try:
            _wall(argv, env)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"{' '.join(argv)} failed ({exc.returncode}): {exc.stderr.decode()[-500:]}") from None
    times: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for i in range(repeats):
        for name in turn_order(names, i):
            times[name].append(_wall(commands[name], env))
    med = {name: statistics.median(values) for name, values in times.items()}
    return {
        "id": "startup",
        "target": f"both < {TARGET_S:.0f} s wall, every run",
        "passed": max(times["help"]) < TARGET_S and max(times["inspect"]) < TARGET_S,
        "measured": f"--help {med['help'] * 1e3:.0f} ms, inspect-capacity {med['inspect'] * 1e3:.0f} ms "
                    f"(warmup {med['warmup']:.2f} s, {med['warmup'] / med['warmup_interpreter_exit']:.2f}x "
                    "its time with the interpreter's teardown)",
        "baseline": f"python -c pass {med['python'] * 1e3:.0f} ms",
        "ratio": max(med["help"], med["inspect"]) / med["python"],
        "python_s": med["python"],
        "help_s": med["help"],
        "inspect_capacity_s": med["inspect"],
        "help_ratio": med["help"] / med["python"],
        "inspect_ratio": med["inspect"] / med["python"],
        "help_max_s": max(times["help"]),
        "inspect_capacity_max_s": max(times["inspect"]),
        "warmup_s": med["warmup"],
        "warmup_interpreter_exit_s": med["warmup_interpreter_exit"],
        "exit_ratio": med["warmup"] / med["warmup_interpreter_exit"],
        "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(commands["inspect"])),
        "repetitions": repeats,
        "clock": "wall",
        "quick": quick,
    }


if __name__ == "__main__":
    sys.exit(cli(run, __doc__))
