"""Run the benchmark suite: print a table and write ``benchmarks/results.json``.

    python -m benchmarks                          # every benchmark (a few minutes on 2 CPU cores)
    python -m benchmarks --quick                  # tiny sizes (smoke run; writes no file unless --json)
    python -m benchmarks --only rolling,resume    # a subset (writes no file unless --json)
    python -m benchmarks --threads 2 --json out.json

Every timed figure compares two things measured side by side in this run
(interleaved; the median of the paired ratios, except churn's throughputs and
startup's medians); capacity compares bytes. See each ``bench_<id>.py``
docstring for what is timed and against which baseline.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import shlex
import sys
import time
import traceback

from ardiff_cli.entry import fill_closed_standard_streams
from ardiff_cli.runtime.errors import plural
from benchmarks.common import (DEFAULT_THREADS, REPO_ROOT, add_attention_backend_option, check_attention_backend,
                               exit_on_signals, json_path, machine_info, positive_int, reader_may_leave,
                               set_attention_backend, set_threads, write_json)

BENCHMARKS = ("attention", "rolling", "resume", "capacity", "overhead", "startup", "churn", "swap")
RESULTS = REPO_ROOT / "benchmarks" / "results.json"


def run_one(name: str, quick: bool) -> dict:
    """``benchmarks.bench_<name>.run(quick)``, normalised to carry measured / baseline / ratio."""
    module = importlib.import_module(f"benchmarks.bench_{name}")
    start = time.perf_counter()
    try:
        result = module.run(quick=quick)
    except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
        return {"id": name, "passed": False, "error": traceback.format_exc(), "seconds": time.perf_counter() - start}
    result["seconds"] = time.perf_counter() - start
    if name == "attention":  # its target is the bare ratio bound; the table says what it bounds
        result["target"] = f"paged/contiguous <= {result['target']:.2f}"
    return result


def format_table(results: list[dict]) -> str:
    rows = [("id", "measured", "baseline", "ratio", "target", "pass")]
    for r in results:
        if "error" in r:
            rows.append((r["id"], "error: " + r["error"].strip().splitlines()[-1], "", "", "", "FAIL"))
            continue
        rows.append((r["id"], str(r.get("measured", "")), str(r.get("baseline", "")),
                     f"{r['ratio']:.3f}" if isinstance(r.get("ratio"), float) else str(r.get("ratio", "")),
                     str(r.get("target", "")), "yes" if r.get("passed") else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    fill_closed_standard_streams()
    description = __doc__.splitlines()[0].replace("``", "`")
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=description)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (a smoke run)")
    parser.add_argument("--only", metavar="ID,ID", help=f"comma-separated subset of: {','.join(BENCHMARKS)}")
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS,
                        help=f"torch intra-op threads for every benchmark, 1 to 1024 (default {DEFAULT_THREADS})")
    # the suite's stdout is its table: `--json -` would mix JSON into it
    stdout = "stdout gets the table, not JSON (a benchmark run alone, python -m benchmarks.bench_ID, prints JSON there)"
    parser.add_argument("--json", type=functools.partial(json_path, stdout=stdout), default=None, metavar="PATH",
                        help=f"results file (default {RESULTS.relative_to(REPO_ROOT)}, for the whole suite only: "
                             "none with --quick or --only)")
    add_attention_backend_option(parser)
    args = parser.parse_args(argv)
    check_attention_backend(parser, args.attention_backend)
    names = list(BENCHMARKS)
    if args.only is not None:  # '' too: it named no benchmark, which ran them all and wrote results.json
        # each once, in the order given: `--only capacity,capacity` ran it twice, two rows of one id
        names = list(dict.fromkeys(name.strip() for name in args.only.split(",") if name.strip()))
        if not names:
            parser.error(f"--only names no benchmark; give one or more of: {', '.join(BENCHMARKS)}")
        unknown = [name for name in names if name not in BENCHMARKS]
        if unknown:
            parser.error(f"unknown benchmark(s) {', '.join(unknown)}; valid: {', '.join(BENCHMARKS)}")
    if args.json is None and not (args.quick or args.only):  # the whole suite's file, checked as --json's is
        try:
            json_path(str(RESULTS))
        except argparse.ArgumentTypeError as error:  # a read-only checkout: minutes of runs, then no file
            parser.error(f"cannot write the default results file: {error}; name another with --json PATH")

    def run() -> int:
        set_threads(args.threads)
        set_attention_backend(args.attention_backend)
        start = time.perf_counter()
        results = []
        for name in names:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results.append(run_one(name, args.quick))
            print(f"  {name}: {results[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
        report = {
            # a shell line that reruns it: `--json "my results.json"` was written as two words
            "command": shlex.join(["python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])]),
            "machine": machine_info(),
            "quick": args.quick,
            "seconds": time.perf_counter() - start,
            "passed": all(r.get("passed") for r in results),
            "results": results,
        }
        # results.json holds the whole suite: a quick or partial run writes a file only when --json names one
        path = args.json if args.json is not None else (None if args.quick or args.only else RESULTS)
        written = path is None or write_json(path, report)  # before the table: stdout's reader may be gone
        with reader_may_leave():
            print(format_table(results))
            machine = report["machine"]
            print(f"\n{plural(len(results), 'benchmark')} in {report['seconds']:.0f} s, "
                  f"{plural(machine['torch_threads'], 'torch thread')}, {plural(machine['cpu_count'], 'CPU')}, "
                  f"torch {machine['torch']}")
            if path is not None and written:
                print(f"wrote {path}")
        if not written:
            return 1
        return 0 if all("error" not in r for r in results) else 1

    return exit_on_signals(run)


if __name__ == "__main__":  # a Ctrl-C before exit_on_signals takes the signals: benchmarks/__init__.py
    sys.exit(main())
