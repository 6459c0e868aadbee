"""Bad input, table-driven: each case has the exact error a user sees, its exit code, and a hint.

Observation files and episode folders fail their own episode (exit 4 while others complete, 2 when none
does); configs and contradictory options fail before anything loads (exit 2). Every message names the
path and the field, says what was expected and what was found, and says how to fix it (``hint:``);
there is no traceback unless --verbose.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_clock import FakeClock
from pipeline_helpers import HOLD_IMPORT, ardiff_program, open_to_write
from typer.testing import CliRunner

from ardiff_cli.app import app
from ardiff_cli.io import write_episode, write_step
from ardiff_cli.io.demo import demo_step
from ardiff_cli.io.episode import EpisodeSource
from ardiff_cli.io.step_file import RawStep, load_step
from ardiff_cli.io.stream import EpisodeEnded, StepScheduler
from ardiff_cli.io.validate import validate_step
from ardiff_cli.runtime.errors import ObservationError, quoted
from ardiff_cli.runtime.observation import ObservationField, ObservationSchema, validate_observation

runner = CliRunner()
FAST_CONFIG = """\
pipeline: dreamzero
model: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}
runtime: {device: cpu, session_capacity: 4}
"""
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "reliability-cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def rollout_of_episodes(tmp_path: Path, eps: Path, cli_env: dict, *, timeout: int) -> subprocess.CompletedProcess:
    """``ardiff rollout`` (plain) of the folder of episodes ``eps`` on the fast config, into ``tmp_path/run``."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    return subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"), str(eps),
                           "--out", str(tmp_path / "run"), "--no-warmup", "--format", "plain"], env=cli_env,
                          capture_output=True, text=True, timeout=timeout)


def ok_steps(run: Path) -> set[tuple[str, int]]:
    """The (episode, step) pairs results.jsonl in ``run`` records as ok."""
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    return {(r["episode"], r["step"]) for r in records if r["status"] == "ok"}


def good(episode: int, step: int) -> dict[str, np.ndarray]:
    from pipelines.dreamzero import observation_schema

    return demo_step(observation_schema(), (16, 16), episode, step, 1 if step == 0 else 4)


def episode(folder: Path, num_steps: int = 2, **changes) -> Path:
    """A valid episode; ``changes`` maps a step number to {key: array or None (drop the key)}."""
    steps = []
    for step in range(num_steps):
        arrays = good(0, step)
        for key, value in changes.get(f"step{step}", {}).items():
            if value is None:
                arrays.pop(key)
            else:
                arrays[key] = value
        steps.append(arrays)
    write_episode(folder, steps, prompt="pick up the cube")
    return folder


def step1(folder: Path) -> Path:
    return folder / "step_000001.safetensors"


def nan_joints() -> np.ndarray:
    joints = np.zeros(7, np.float32)
    joints[3] = np.nan
    return joints


def write_bytes(folder: Path, data: bytes) -> None:
    episode(folder)
    step1(folder).write_bytes(data)


def truncate(folder: Path) -> None:
    episode(folder)
    data = step1(folder).read_bytes()
    step1(folder).write_bytes(data[: len(data) - 100])


def pickled_npz(folder: Path) -> None:
    episode(folder, 1)
    np.savez(folder / "step_000001.npz", joint_position=np.array([{"a": 1}], dtype=object))


def npz_declaring_terabytes(folder: Path) -> None:
    """An .npz whose array header declares 14.6 TiB over 28 bytes of data: np.load allocated the declared size first,
    and the step failed as out of memory (exit 3, a hint to lower --session-capacity)."""
    import zipfile

    episode(folder, 1)
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (4000000000000,), }".ljust(117) + "\n"
    with zipfile.ZipFile(folder / "step_000001.npz", "w") as archive:
        archive.writestr("joint_position.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little")
                         + header.encode() + bytes(28))


def npz_prompt(folder: Path, prompt: object) -> None:
    """Step 1 an .npz holding the prompt, in the form ``prompt`` has, among its arrays."""
    episode(folder, 1)
    np.savez(folder / "step_000001.npz", **good(0, 1), prompt=prompt)


def gap(folder: Path) -> None:
    episode(folder, 4)
    (folder / "step_000002.safetensors").unlink()


def header_only(folder: Path, header: dict) -> None:
    """Step 1 a safetensors file of ``header`` and no data: one safetensors reads."""
    text = json.dumps(header).encode()
    write_bytes(folder, len(text).to_bytes(8, "little") + text)


def timestamp_names(folder: Path) -> None:
    """Step 2 named by a timestamp: a gap of 10**12 steps, which were listed one by one until the memory ran out."""
    episode(folder, 3)
    (folder / "step_000002.safetensors").rename(folder / "step_1733312345123.safetensors")


def capitals(folder: Path) -> None:
    """Step 2 renamed with its suffix in capitals, which ardiff does not read: the error said "step 2 missing"
    without naming the file that was there; now it names that file (first or last, it was passed over)."""
    episode(folder, 4)
    (folder / "step_000002.safetensors").rename(folder / "step_000002.SAFETENSORS")


def duplicate(folder: Path) -> None:
    episode(folder, 2)
    write_step(folder, 1, good(0, 1), format="npz")


def dangling_link(folder: Path) -> None:
    episode(folder)
    step1(folder).unlink()
    step1(folder).symlink_to("../../nas/arm/step_000001.safetensors")  # the recording's disk is not mounted


def unreadable_file(folder: Path) -> None:
    episode(folder)
    step1(folder).chmod(0)


# episode -> (how to break it, [expected message parts], expected hint part). {path} is the step-1 file,
# {folder} the episode folder. Each is what `ardiff rollout` prints after "Error: episode '<name>' failed: ".
OBSERVATION_CASES = {
    "missing_key": (lambda f: episode(f, step1={"joint_position": None}),
                    ["{path}: missing 'joint_position' (also accepted as: observation/joint_position)"],
                    "fields: exterior_image_0"),
    # joints as integers, a gripper as bool: said what they are, not the cast that makes them float32
    "wrong_dtype": (lambda f: episode(f, step1={"joint_position": np.zeros(7, np.int64)}),
                    ["{path}: 'joint_position' has dtype int64, expected a floating dtype (float32)"],
                    "'joint_position' takes float32: write np.asarray(x).astype(np.float32)"),
    "gripper_as_bool": (lambda f: episode(f, step1={"gripper_position": np.ones((4, 1), bool)}),
                        ["{path}: 'gripper_position' has dtype bool, expected a floating dtype (float32)"],
                        "'gripper_position' takes float32: write np.asarray(x).astype(np.float32)"),
    # a depth or grey frame, uint16 (H, W): it named the dtype alone, and the shape failed on the next run
    "frame_uint16_grey": (lambda f: episode(f, step1={"wrist_image": np.zeros((16, 16), np.uint16)}),
                          ["{path}: 'wrist_image' has dtype uint16, expected uint8, and shape (16, 16), expected "
                           "(*, *, 3) or (*, *, *, 3)"], "fields:"),
    # frames from torch (.long()) or np.array(img, dtype=int): said what they are, not how to make them uint8
    "frames_as_int64": (lambda f: episode(f, step1={"wrist_image": np.zeros((4, 16, 16, 3), np.int64)}),
                        ["{path}: 'wrist_image' has dtype int64, expected uint8"],
                        "'wrist_image' takes uint8, 0 to 255 (a camera frame's pixels): from integers in 0..255, "
                        "write np.clip(np.asarray(x), 0, 255).astype(np.uint8)"),
    # channel-first frames (torchvision's (C, H, W)), as floats in [0, 1]: each fix was found one run at a time
    "frames_channel_first": (lambda f: episode(f, step1={"wrist_image": np.zeros((4, 3, 16, 16), np.float32)}),
                             ["{path}: 'wrist_image' has dtype float32, expected uint8"],
                             "'wrist_image' is channel-first, (..., 3, H, W): channels go last, (..., H, W, 3): "
                             "write np.ascontiguousarray(np.moveaxis(np.asarray(x), -3, -1))"),
    # the prompt in an .npz as bytes or as a list of one string: "must be a string", and no word of how to write it
    "npz_prompt_as_bytes": (lambda f: npz_prompt(f, b"pick"),
                            ["{folder}/step_000001.npz: prompt 'prompt' must be a string, got ndarray"],
                            "'prompt' takes text, a str, which np.savez stores as a 0-d string array: from bytes x, "
                            "write np.savez(path, **arrays, prompt=np.asarray(x).item().decode())"),
    "npz_prompt_as_list": (lambda f: npz_prompt(f, np.array(["pick"])),
                           ["{folder}/step_000001.npz: prompt 'prompt' must be a string, got ndarray"],
                           "'prompt' takes text, a str, which np.savez stores as a 0-d string array: from an array "
                           "of one string x, write np.savez(path, **arrays, prompt=str(np.asarray(x).item()))"),
    "wrong_shape": (lambda f: episode(f, step1={"gripper_position": np.zeros((2, 2), np.float32)}),
                    ["{path}: 'gripper_position' has shape (2, 2), expected () or (1,) or (*, 1)"], "fields:"),
    "nan": (lambda f: episode(f, step1={"joint_position": nan_joints()}),
            ["{path}: 'joint_position' has 1 NaN and 0 Inf values (first at index (3,)), expected finite numbers"],
            "sensor dropout"),
    "inf": (lambda f: episode(f, step1={"gripper_position": np.array([np.inf], np.float32)}),
            ["{path}: 'gripper_position' has 0 NaN and 1 Inf values (first at index (0,))"], "finite"),
    # a finite float64 that float32 cannot hold: it read "0 NaN and 1 Inf values", after numpy's RuntimeWarning
    "past_float32": (lambda f: episode(f, step1={"joint_position": np.array([0, 1e300, 0, 0, 0, 0, -1e39])}),
                     ["{path}: 'joint_position' has 2 values past float32's range (first at index (1,): 1e+300), "
                      "expected finite numbers of magnitude up to 3.4e+38"], "sensor dropout"),
    "empty_file": (lambda f: write_bytes(f, b""), ["{path}: the file is empty (0 bytes)"], "written completely"),
    "truncated": (truncate, ["{path}: cannot read safetensors file: truncated or corrupt"], "temporary name"),
    "cut_header": (lambda f: write_bytes(f, b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\""),
                   ["{path}: cannot read safetensors file: truncated (its header alone should take 64 bytes; "
                    "the file has 12 bytes in all)"], "--resume"),
    # safetensors takes an empty tensor of any shape, which numpy cannot: it failed "while reading" as a bug (exit 1)
    "shape_no_array_holds": (lambda f: header_only(f, {"wrist_image": {"dtype": "U8", "shape": [0, 2 ** 62, 3],
                                                                       "data_offsets": [0, 0]}}),
                             ["{path}: tensor 'wrist_image' has shape [0, 4611686018427387904, 3], which no array can "
                              "hold (array is too big"], "header is damaged"),
    "shape_of_100_dimensions": (lambda f: header_only(f, {"joint_position": {"dtype": "F32", "shape": [0] * 100,
                                                                             "data_offsets": [0, 0]}}),
                                ["{path}: tensor 'joint_position' has shape [0, 0, 0, 0, 0, 0, 0, 0, ...], which no "
                                 "array can hold (maximum supported dimension"], "header is damaged"),
    # a file cut right after its header length of 384 bytes (0x80 0x01 0 ...): it was called a pickle
    "cut_after_header_length": (lambda f: write_bytes(f, (384).to_bytes(8, "little")),
                                ["{path}: cannot read safetensors file: truncated (its header alone should take 384 "
                                 "bytes; the file has 8 bytes in all)"], "--resume"),
    "png_renamed": (lambda f: write_bytes(f, b"\x89PNG\r\n\x1a\n" + bytes(64)),
                    ["{path}: cannot read safetensors file: it is a PNG image, not safetensors"], "uint8 arrays"),
    "pickle_renamed": (lambda f: write_bytes(f, pickle.dumps({"joint_position": [0.0] * 7})),
                       ["{path}: cannot read safetensors file: it is a pickle (torch.save / pickle.dump)"],
                       "never unpickles"),
    "npz_object_array": (pickled_npz, ["{folder}/step_000001.npz: cannot read .npz without pickle: Object arrays "
                                       "cannot be loaded when allow_pickle=False"], "plain numeric arrays"),
    "npz_declaring_terabytes": (npz_declaring_terabytes, [
        "{folder}/step_000001.npz: cannot read .npz file: truncated or corrupt: array 'joint_position' declares shape "
        "(4000000000000,) of float32 (16000000000000 bytes), and its member holds 28 bytes"], "written completely"),
    "gap": (gap, ["{folder}: step 2 missing: the episode has steps 0..3 with a gap (expected consecutive step "
                  "numbers)"], "renumber"),
    "timestamp_names": (timestamp_names, ["{folder}: steps 2, 3, 4, 5, 6 and 1733312345116 more missing: the episode "
                                          "has steps 0..1733312345123 with a gap"], "renumber"),
    "capitals": (capitals, ["{folder}/step_000002.SAFETENSORS: a step file's suffix must be in lower case "
                            "(.safetensors or .npz): ardiff does not read this one"],
                 "rename it: mv {folder}/step_000002.SAFETENSORS {folder}/step_000002.safetensors"),
    "duplicate": (duplicate, ["{folder}: two files for step 1: step_00000"], "one file per step"),
    "empty_folder": (lambda f: f.mkdir(parents=True), ["{folder}: the episode folder holds no step files"],
                     "--follow"),
    # data/run1/episode_000/step_*, given as data: run1 "holds no step files", of a folder full of episodes
    "episodes_one_level_down": (lambda f: [episode(f / name) for name in ("episode_000", "episode_001")],
                                ["{folder}: the episode folder holds no step files, but its sub-folders episode_000, "
                                 "episode_001 look like episode folders, one level down"], "give {folder} as EPISODE"),
    # np.save's files: "holds no step files" of a folder the user could see full of them
    "npy_steps": (lambda f: f.mkdir(parents=True) or [np.save(f / f"step_{i}.npy", np.zeros(7)) for i in range(4)],
                  ["{folder}: the episode folder holds no step files (it holds step_0.npy, step_1.npy, step_2.npy, "
                   "...: a step file is .safetensors or .npz)"], "ardiff_cli.io.write_step writes them"),
    # it said "missing prompt" alone, though the prompt was there under a misspelt key (never read)
    "misspelt_prompt": (lambda f: episode(f) and (f / "episode.yaml").write_text("promt: pick up the cube\n"),
                        ["{folder}/step_000000.safetensors: missing prompt 'prompt' or 'language_instruction'; "
                         "{folder}/episode.yaml has 'promt' (did you mean 'prompt'?)"], "rename that key to 'prompt'"),
    # the hint said "rename that key to 'prompt'" whatever prompt key the did-you-mean named
    "misspelt_alias_of_prompt": (lambda f: episode(f) and (f / "episode.yaml").write_text("language_instructon: p\n"),
                                 ["{folder}/step_000000.safetensors: missing prompt 'prompt' or "
                                  "'language_instruction'; {folder}/episode.yaml has 'language_instructon' (did you "
                                  "mean 'language_instruction'?)"], "rename that key to 'language_instruction'"),
    # it had the hint to check permissions, of a folder the user could read
    "episode_yaml_folder": (lambda f: episode(f) and ((f / "episode.yaml").unlink() or (f / "episode.yaml").mkdir()),
                            ["{folder}/episode.yaml: cannot read episode metadata: it is a folder, not a file"],
                            "move that folder out of the episode folder"),
    # no prompt anywhere: the hint listed the schema's fields "and the prompt 'prompt'", as if it were one more
    # array in the step file, and never said that a recorded episode's prompt goes in its episode.yaml
    "no_prompt": (lambda f: episode(f) and (f / "episode.yaml").unlink(),
                  ["{folder}/step_000000.safetensors: missing prompt 'prompt' or 'language_instruction'"],
                  "put `prompt: ...` in {folder}/episode.yaml"),
    # it read "cannot read the step file: No such file or directory" of a file the user could see listed
    "dangling_link": (dangling_link, ["{path}: cannot read the step file: it is a link to "
                                      "../../nas/arm/step_000001.safetensors, which does not exist"], "mount the disk"),
}
if not IS_ROOT:  # root reads anything; the permission case is also checked below, with file modes made to bind
    OBSERVATION_CASES["unreadable"] = (unreadable_file, ["{path}: cannot read the step file: Permission denied"],
                                       "permissions")


def expected(parts: list[str], folder: Path) -> list[str]:
    return [p.format(path=step1(folder), folder=folder) for p in parts]


def first_error(folder: Path) -> ObservationError:
    """What the rollout would meet first in this episode: a folder error, or the first bad step file."""
    from pipelines.dreamzero import observation_schema

    source = EpisodeSource(name=folder.name, path=folder)
    scheduler = StepScheduler([source])
    while (item := scheduler.next()) is not None:
        if isinstance(item, EpisodeEnded):
            if item.error is not None:
                return item.error
            continue
        try:
            validate_step(load_step(item.file.path), observation_schema(), path=item.file.path,
                          episode_metadata=source.metadata())
        except ObservationError as exc:
            return exc
    pytest.fail(f"{folder}: no error")


@pytest.mark.parametrize("case", sorted(OBSERVATION_CASES))
@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's own ("overflow encountered in cast") is not the message
def test_observation_case_message(tmp_path, case):
    build, parts, hint = OBSERVATION_CASES[case]
    folder = tmp_path / case
    build(folder)
    error = first_error(folder)
    for part in expected(parts, folder):
        assert part in str(error)
    assert hint.format(folder=folder) in error.hint


def test_extra_key_is_a_warning_not_an_error(tmp_path):
    from pipelines.dreamzero import observation_schema

    folder = episode(tmp_path / "extra", step1={"timestamp": np.zeros(1), "jont_position": np.zeros(7, np.float32)})
    valid = validate_step(load_step(step1(folder)), observation_schema(), path=step1(folder),
                          episode_metadata={"prompt": "p"})
    assert valid.warnings == {
        "jont_position": f"{step1(folder)}: key 'jont_position' is not in the pipeline's schema; ignored (did you "
                         "mean 'joint_position'?)",
        "timestamp": f"{step1(folder)}: key 'timestamp' is not in the pipeline's schema; ignored"}


def test_a_file_of_many_extra_keys_names_ten_and_counts_the_rest(tmp_path):
    """A step file of 200,000 other arrays printed 200,000 warning lines, or an error message of 2 MB, and looked
    for a did-you-mean of each key at every step (seconds a step)."""
    from pipelines.dreamzero import observation_schema

    extra = {f"t{i:02d}": np.zeros(0, np.uint8) for i in range(25)}
    path = tmp_path / "step_000001.safetensors"
    valid = validate_step(RawStep(arrays={**good(0, 1), **extra}, metadata={}), observation_schema(), path=path,
                          episode_metadata={"prompt": "p"})
    assert list(valid.warnings) == [f"t{i:02d}" for i in range(11)]
    assert valid.warnings["t10"] == (f"{path}: 15 more keys not in the pipeline's schema ('t10', 't11', 't12', ...); "
                                     "ignored")
    arrays = {**good(0, 1), **extra}
    del arrays["joint_position"]
    with pytest.raises(ObservationError) as info:
        validate_step(RawStep(arrays=arrays, metadata={}), observation_schema(), path=path,
                      episode_metadata={"prompt": "p"})
    assert str(info.value).endswith("the file's other keys, not in the schema: 't00', 't01', 't02', 't03', 't04', "
                                    "'t05', 't06', 't07', 't08', 't09' and 15 more")


def test_the_did_you_mean_of_a_key_outside_the_schema_is_looked_for_once_not_at_every_step(tmp_path, monkeypatch):
    """A recording's keys outside the schema (a timestamp, a frame index) are in each of its step files: the
    did-you-mean of each was looked for again at every step (ten such keys: 15 ms a step on a busy CPU, a name
    difflib finds nothing for being compared with each of the schema's keys as one they begin or hold the words of)."""
    from pipelines.dreamzero import observation_schema

    from ardiff_cli.runtime import errors

    looked_for: dict[str, int] = {}
    close_match = errors.close_match

    def counted(name, valid, *args, **kwargs):  # the real close_match, counted
        looked_for[name] = looked_for.get(name, 0) + 1
        return close_match(name, valid, *args, **kwargs)

    monkeypatch.setattr(errors, "close_match", counted)
    extra = {"timestamp": np.zeros(1), "frame_index": np.zeros(1, np.int64), "jont_position": np.zeros(7)}
    for step in (1, 2, 3):
        path = tmp_path / f"step_{step:06d}.safetensors"
        valid = validate_step(RawStep(arrays={**good(0, step), **extra}, metadata={}), observation_schema(),
                              path=path, episode_metadata={"prompt": "p"})
        assert valid.warnings["jont_position"] == (f"{path}: key 'jont_position' is not in the pipeline's schema; "
                                                   "ignored (did you mean 'joint_position'?)")
        assert valid.warnings["timestamp"] == f"{path}: key 'timestamp' is not in the pipeline's schema; ignored"
    assert all(count <= 1 for count in looked_for.values()), looked_for  # none at all where an earlier test looked


def test_a_file_none_of_whose_arrays_is_in_a_schema_of_optional_fields_fails_instead_of_running_on_the_prompt(
        tmp_path):
    """A DreamZero recording given to causal-world-tiny (whose one field is optional): every array was ignored with
    a warning and the model ran on the prompt alone, "rollout ok", exit 0. It fails naming the file's arrays and the
    schema's; a file with one field of the schema beside extra keys, or with no arrays at all, still runs."""
    from pipelines.causal_world.config import observation_schema

    schema = observation_schema()
    folder = episode(tmp_path / "dreamzero_recording", 1)
    with pytest.raises(ObservationError) as info:
        validate_step(load_step(folder / "step_000000.safetensors"), schema, path=folder / "step_000000.safetensors",
                      episode_metadata={"prompt": "p"})
    assert str(info.value) == (
        f"{folder / 'step_000000.safetensors'}: none of the file's arrays ('cartesian_position', 'exterior_image_0', "
        "'exterior_image_1', 'gripper_position', 'joint_position', 'wrist_image') is in the pipeline's schema "
        "('conditioning' ('action', 'camera')): the model would run on the prompt alone")
    assert info.value.hint.startswith("is this the right CONFIG?")
    # after steps of its episode ran with this config, such a file is a bad file, not another pipeline's recording
    with pytest.raises(ObservationError) as info:
        validate_step(load_step(folder / "step_000000.safetensors"), schema, path=folder / "step_000000.safetensors",
                      episode_metadata={"prompt": "p"}, midway=True)
    assert type(info.value) is ObservationError and info.value.hint is None
    for arrays in ({"action": np.zeros(8, np.float32), "timestamp": np.zeros(1)}, {}):
        valid = validate_step(RawStep(arrays=arrays, metadata={}), schema, path=tmp_path / "s.npz",
                              episode_metadata={"prompt": "p"})
        assert valid.inputs["prompt"] == "p" and list(valid.warnings) == (["timestamp"] if arrays else [])


def test_a_file_failing_for_a_missing_key_names_the_keys_it_holds_instead(tmp_path):
    # "missing 'joint_position' (also accepted as: ...)" never named the file's 'jont_position': the warning that
    # would have is not shown for a file that fails.
    from pipelines.dreamzero import observation_schema

    folder = episode(tmp_path / "typo", step1={"joint_position": None, "jont_position": np.zeros(7, np.float32),
                                               "timestamp": np.zeros(1)})
    with pytest.raises(ObservationError) as info:
        validate_step(load_step(step1(folder)), observation_schema(), path=step1(folder),
                      episode_metadata={"prompt": "p"})
    assert str(info.value).startswith(f"{step1(folder)}: missing 'joint_position' (also accepted as: ")
    assert str(info.value).endswith("; the file's other keys, not in the schema: 'jont_position' (did you mean "
                                    "'joint_position'?), 'timestamp'")


def test_a_misspelt_key_is_no_recording_made_for_another_pipeline(tmp_path):
    """A converter's misspelt key ('conditionng', causal-world-tiny's one array; 'jont_position', DreamZero's other
    arrays left out) was taken for a recording made for another pipeline, whose run ends hinting a new run with the
    recording's config (``ForeignRecording``): renaming the key and --resume finishes it. causal-world's error did not
    name the key it is near. A file holding a key near one of the schema's is a bad file, named as such."""
    from pipelines.causal_world.config import observation_schema as causal_world
    from pipelines.dreamzero import observation_schema as dreamzero

    for schema, key, near in ((causal_world(), "conditionng", "conditioning"),
                              (dreamzero(), "jont_position", "joint_position")):
        path = write_step(tmp_path / key, 0, {key: np.zeros(7, np.float32)})
        with pytest.raises(ObservationError) as info:
            validate_step(load_step(path), schema, path=path, episode_metadata={"prompt": "p"})
        assert type(info.value) is ObservationError, info.value
        assert f"{key!r} (did you mean {near!r}?)" in str(info.value), info.value


@pytest.fixture(scope="module")
def bad_dataset(tmp_path_factory):
    """One folder of episodes: every bad case, one episode with extra keys, and one healthy episode."""
    root = tmp_path_factory.mktemp("dataset")
    (root / "fast.yaml").write_text(FAST_CONFIG)
    for case, (build, _, _) in OBSERVATION_CASES.items():
        build(root / "eps" / case)
    episode(root / "eps" / "healthy", 3)
    episode(root / "eps" / "extra_key", 2, step1={"timestamp": np.zeros(1)})
    return root


def test_rollout_fails_each_bad_episode_with_its_message_and_goes_on(bad_dataset, tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["rollout", str(bad_dataset / "fast.yaml"), str(bad_dataset / "eps"), "--out",
                                 str(out), "--order", "sequential", "--no-warmup", "--format", "plain"])
    assert result.exit_code == 4, result.stderr
    err = result.stderr
    assert "Traceback" not in err
    for case, (_, parts, hint) in OBSERVATION_CASES.items():
        folder = bad_dataset / "eps" / case
        for part in expected(parts, folder):
            assert f"Error: episode '{case}' failed: {part}" in err
    assert err.count("hint: ") >= len(OBSERVATION_CASES) + 1
    extra = step1(bad_dataset / "eps" / "extra_key")
    assert f"warning: {extra}: key 'timestamp' is not in the pipeline's schema" in err

    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    failed = {r["episode"]: r for r in lines if r["status"] == "failed"}
    assert set(failed) == set(OBSERVATION_CASES)
    assert all(r["error_type"] == "ObservationError" for r in failed.values())
    ok = {(r["episode"], r["step"]) for r in lines if r["status"] == "ok"}
    assert {("healthy", 0), ("healthy", 1), ("healthy", 2), ("extra_key", 0), ("extra_key", 1)} <= ok
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "partial" and summary["episodes"]["completed"] == 2


def test_an_input_the_pipeline_refuses_is_reported_with_its_step_file(bad_dataset, tmp_path):
    # Valid file by file (the schema allows any frame count); only the pipeline knows a request carries 4 frames.
    folder = tmp_path / "three_frames"
    episode(folder, 2, step1={k: v[:3] for k, v in good(0, 1).items() if v.ndim == 4})
    result = runner.invoke(app, ["rollout", str(bad_dataset / "fast.yaml"), str(folder), "--out",
                                 str(tmp_path / "run"), "--no-warmup", "--format", "plain", "--fail-fast"])
    assert result.exit_code == 2, result.stderr
    assert (f"Error: episode 'three_frames' failed: {step1(folder)}: request inputs: cameras carry 3 frames; "
            "expected 1 (a session's first request) or 4\nhint: each camera's array is (frames, height, width, 3)"
            ) in result.stderr, result.stderr
    assert result.stderr.count("Error: ") == 1  # --fail-fast: the error is shown once, when the run stops


def test_only_bad_episodes_exit_2_and_verbose_shows_the_traceback(bad_dataset, tmp_path):
    eps = [str(bad_dataset / "eps" / case) for case in ("nan", "gap")]
    result = runner.invoke(app, ["rollout", str(bad_dataset / "fast.yaml"), *eps, "--out", str(tmp_path / "a"),
                                 "--no-warmup", "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert re.search(r"Error: every episode failed \((nan, gap|gap, nan)\)", result.stderr)
    assert "Traceback" not in result.stderr
    result = runner.invoke(app, ["rollout", str(bad_dataset / "fast.yaml"), eps[0], "--out", str(tmp_path / "b"),
                                 "--no-warmup", "--format", "json", "--fail-fast", "--verbose"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["kind"] == "observation_error"


def test_an_episode_yaml_of_the_wrong_type_is_named_not_the_step_file_that_took_its_prompt(tmp_path, cli_env):
    # `prompt: 5` (or `prompt:`, null) read `ep/step_000000.safetensors: prompt 'prompt' must be a string, got int`,
    # sending the user to a step file that holds no prompt; an episode.yaml that is no mapping came after the step
    # file's path (`ep/step_000000.safetensors: ep/episode.yaml: ...`) and without a hint.
    eps = tmp_path / "eps"
    # and a prompt given twice ran with the second, silently
    texts = {"number": "prompt: 5\n", "null": "prompt:\n", "list": "- pick up the cube\n",
             "twice": "prompt: pick up the cube\nprompt: put down the cube\n",
             # YAML's escape of no character: it passed as text and failed in the model's forward (UnicodeEncodeError)
             "surrogate": 'prompt: "pick \\udcff up"\n'}
    for name, text in texts.items():
        episode(eps / name, 1)
        (eps / name / "episode.yaml").write_text(text)
    episode(eps / "healthy", 1)
    proc = rollout_of_episodes(tmp_path, eps, cli_env, timeout=300)
    assert proc.returncode == 4, proc.stderr
    said = {"number": "field 'prompt': expected the prompt as text, got 5",
            "null": "field 'prompt': expected the prompt as text, got None",
            "list": "episode metadata must be a YAML mapping, got list",
            "twice": "key 'prompt' is given twice (lines 1 and 2); YAML would keep the second silently",
            "surrogate": "field 'prompt': the prompt holds '\\udcff' at position 5, a lone surrogate that is no "
                         "character"}
    for name, message in said.items():
        assert f"Error: episode '{name}' failed: {eps / name / 'episode.yaml'}: {message}\nhint: " in proc.stderr, (
            proc.stderr)
    assert "step_000000.safetensors: " not in proc.stderr and "Traceback" not in proc.stderr
    assert 'hint: write it as one line of text, quoted if YAML would read it as something else: prompt: "pick' in (
        proc.stderr)
    assert 'character\nhint: write the prompt as plain UTF-8 text, without \\udcXX escapes: prompt: "pick' in (
        proc.stderr)


def test_an_episode_yaml_or_step_file_that_is_a_fifo_fails_its_episode_instead_of_hanging_the_run(tmp_path, cli_env):
    # Opening a FIFO waits for a writer: the run hung before its first step, and SIGTERM (which only marks a stop)
    # did not end it. A step file linked to one passed the scan (a link is kept, so that reading it names a problem);
    # one that is a FIFO was passed over: its episode ended one step short, "complete".
    eps = tmp_path / "eps"
    episode(eps / "fifo", 1)
    os.mkfifo(eps / "fifo" / "step_000001.safetensors")
    episode(eps / "meta", 1)
    (eps / "meta" / "episode.yaml").unlink()
    os.mkfifo(eps / "meta" / "episode.yaml")
    episode(eps / "linked", 1)
    os.mkfifo(tmp_path / "fifo")
    (eps / "linked" / "step_000001.safetensors").symlink_to(tmp_path / "fifo")
    episode(eps / "healthy", 1)
    proc = rollout_of_episodes(tmp_path, eps, cli_env, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert (f"Error: episode 'meta' failed: {eps / 'meta' / 'episode.yaml'}: cannot read episode metadata: it is a "
            "FIFO, socket or device, not a file\n") in proc.stderr, proc.stderr
    for name in ("linked", "fifo"):
        assert (f"Error: episode '{name}' failed: {eps / name / 'step_000001.safetensors'}: cannot read the step "
                "file: it is a FIFO, socket or device, not a file\n") in proc.stderr, proc.stderr
    assert ok_steps(tmp_path / "run") == {("healthy", 0), ("linked", 0), ("fifo", 0)}


def test_a_folder_named_like_a_step_file_fails_its_episode_naming_it(tmp_path, cli_env):
    # A folder step_000001.safetensors was passed over: as the last step its episode ended one step short,
    # "complete"; in the middle it was "step 1 missing ... a gap", which did not say what was in the way.
    eps = tmp_path / "eps"
    episode(eps / "last", 1)
    (eps / "last" / "step_000001.safetensors").mkdir()
    episode(eps / "middle", 2)
    (eps / "middle" / "step_000001.safetensors").rename(eps / "middle" / "step_000002.safetensors")
    (eps / "middle" / "step_000001.safetensors").mkdir()
    episode(eps / "healthy", 1)
    proc = rollout_of_episodes(tmp_path, eps, cli_env, timeout=120)
    assert proc.returncode == 4, proc.stderr
    for name in ("last", "middle"):
        assert (f"Error: episode '{name}' failed: {eps / name / 'step_000001.safetensors'}: cannot read the step "
                "file: it is a folder, not a file\nhint: move that folder out of the episode folder") in proc.stderr, (
            proc.stderr)
    assert ok_steps(tmp_path / "run") == {("healthy", 0), ("last", 0), ("middle", 0)}


@pytest.mark.parametrize("follow", [False, True])
def test_a_step_file_whose_suffix_is_in_capitals_fails_its_episode_naming_it(tmp_path, cli_env, follow):
    # step_000001.SAFETENSORS (a tool that writes suffixes in capitals) was passed over: as the last step its episode
    # ran one step short and was "complete", as the first it started from step 1, both without a word; only in the
    # middle did it fail (a gap). Its bytes are a step's: it fails its episode naming it and the rename to paste.
    eps = tmp_path / "eps"
    episode(eps / "last", 2)
    step1(eps / "last").rename(eps / "last" / "step_000001.SAFETENSORS")
    episode(eps / "first", 2)
    (eps / "first" / "step_000000.safetensors").rename(eps / "first" / "step_000000.Safetensors")
    episode(eps / "healthy", 1)
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"),
                           str(eps / "last"), str(eps / "first"), str(eps / "healthy"), "--out", str(tmp_path / "run"),
                           "--no-warmup", "--format", "plain", *(["--follow", "--idle-timeout", "5"] * follow)],
                          env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    for name, file, lower in (("last", "step_000001.SAFETENSORS", "step_000001.safetensors"),
                              ("first", "step_000000.Safetensors", "step_000000.safetensors")):
        assert (f"Error: episode '{name}' failed: {eps / name / file}: a step file's suffix must be in lower "
                "case (.safetensors or .npz): ardiff does not read this one, so its step would be left out of the "
                f"episode\nhint: rename it: mv {eps / name / file} {eps / name / lower}") in proc.stderr, proc.stderr
    assert ("healthy", 0) in ok_steps(tmp_path / "run")
    assert not {("last", 1), ("first", 0)} & ok_steps(tmp_path / "run")
    # renamed as the hint says, the run's resume runs what is left of both
    for name, file, lower in (("last", "step_000001.SAFETENSORS", "step_000001.safetensors"),
                              ("first", "step_000000.Safetensors", "step_000000.safetensors")):
        (eps / name / file).rename(eps / name / lower)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(tmp_path / "run"),
                           "--format", "plain"], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {("last", 0), ("last", 1), ("first", 0), ("first", 1)} <= ok_steps(tmp_path / "run")


@pytest.mark.parametrize("follow", [False, True])
def test_step_files_in_capitals_are_renamed_by_one_hint_never_over_their_steps_file(tmp_path, cli_env, follow):
    # A recorder that writes suffixes in capitals writes every step so: named one a run ("rename it: mv ..."), its 3
    # steps took 4 runs (500 took 501). And a copy beside its step's file was "rename it: mv A a": pasted, it replaced
    # that step's file with the copy.
    eps = tmp_path / "eps"
    every = episode(eps / "it's every", 3)
    for step in range(3):
        (every / f"step_{step:06d}.safetensors").rename(every / f"step_{step:06d}.SAFETENSORS")
    twin = episode(eps / "twin", 2)
    (twin / "step_000001.SAFETENSORS").write_bytes(b"a copy, not the step")
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"), str(every),
                           str(twin), "--out", str(tmp_path / "run"), "--no-warmup", "--format", "plain",
                           *(["--follow", "--idle-timeout", "5"] * follow)],
                          env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    said = f"Error: episode \"it's every\" failed: {every}: 3 step files' suffixes must be in lower case"
    error = next(i for i, line in enumerate(lines) if line.startswith(said))
    assert lines[error] == (f"{said} (.safetensors or .npz): ardiff does not read step_000000.SAFETENSORS, "
                            "step_000001.SAFETENSORS and 1 more, so their steps would be left out of the episode")
    assert lines[error + 1].startswith("hint: rename them: for f in "), lines[error + 1]
    subprocess.run(lines[error + 1].removeprefix("hint: rename them: "), shell=True, executable="/bin/bash",
                   check=True)
    assert sorted(p.name for p in every.glob("step_*")) == [f"step_{s:06d}.safetensors" for s in range(3)]
    said = f"Error: episode 'twin' failed: {twin / 'step_000001.SAFETENSORS'}: "
    error = next(i for i, line in enumerate(lines) if line.startswith(said))
    assert lines[error] == (f"{said}a step file's suffix must be in lower case (.safetensors or .npz): ardiff does "
                            "not read this one, and step_000001.safetensors is beside it")
    removed = f"rm {shlex.quote(str(twin / 'step_000001.SAFETENSORS'))}"
    assert lines[error + 1] == (f"hint: keep one file per step: if step_000001.safetensors is the step, delete this "
                                f"one ({removed}); if this one is, replace it (mv {twin / 'step_000001.SAFETENSORS'} "
                                f"{twin / 'step_000001.safetensors'})"), lines[error + 1]
    assert (twin / "step_000001.SAFETENSORS").read_bytes() == b"a copy, not the step"  # nothing moved over it
    subprocess.run(removed, shell=True, check=True)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(tmp_path / "run"),
                           "--format", "plain"], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {("it's every", s) for s in range(3)} | {("twin", 0), ("twin", 1)} <= ok_steps(tmp_path / "run")


@pytest.mark.parametrize("follow", [False, True])
def test_a_step_file_in_capitals_without_a_step_number_is_named_for_both_at_once(tmp_path, cli_env, follow):
    """STEP.SAFETENSORS (a recorder's last step written in capitals, with no number) failed its episode for its
    suffix alone ("rename it: mv .../STEP.SAFETENSORS .../STEP.safetensors"): pasted, the resume failed it again,
    "step file name has no step number". The one error names both, and its hint, given the step, finishes the run."""
    eps = tmp_path / "eps"
    folder = episode(eps / "arm", 2)
    step1(folder).rename(folder / "STEP.SAFETENSORS")
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"), str(folder),
                           "--out", str(tmp_path / "run"), "--no-warmup", "--format", "plain",
                           *(["--follow", "--idle-timeout", "5"] * follow)],
                          env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: episode 'arm' failed: {folder / 'STEP.SAFETENSORS'}: a step file's suffix must be in lower case "
            "(.safetensors or .npz): ardiff does not read this one, and its name has no step number, so its step "
            "would be left out of the episode\n") in proc.stderr, proc.stderr
    hint = f"hint: rename it by its step, with the suffix in lower case: mv {folder / 'STEP.SAFETENSORS'} {folder}/"
    rename = next(line for line in proc.stderr.splitlines() if line.startswith(hint))
    command = rename.removeprefix("hint: rename it by its step, with the suffix in lower case: ").split(" (", 1)[0]
    subprocess.run(command.replace("NNNNNN", "000001"), shell=True, executable="/bin/bash", check=True)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(tmp_path / "run"),
                           "--no-warmup", "--format", "plain"], env=cli_env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ok_steps(tmp_path / "run") == {("arm", 0), ("arm", 1)}


def test_step_files_in_capitals_one_without_a_number_and_in_npz_are_named_apart_and_renamed_as_npz(tmp_path, cli_env):
    """step_000000.SAFETENSORS and STEP.NPZ (step 1, written by np.savez): the error read "ardiff does not read
    STEP.NPZ, step_000000.SAFETENSORS, and STEP.NPZ has no step number", a list of three where there are two files,
    and its hint said to name the one without a number step_000001.safetensors: an .npz renamed so is not read as
    one. It says the name has no number apart, and gives the suffix that file has; done so, the resume runs it."""
    folder = episode(tmp_path / "eps" / "arm", 2)
    (folder / "step_000000.safetensors").rename(folder / "step_000000.SAFETENSORS")
    step1(folder).unlink()
    np.savez(folder / "STEP.npz", **good(0, 1))
    (folder / "STEP.npz").rename(folder / "STEP.NPZ")
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"), str(folder),
                           "--out", str(tmp_path / "run"), "--no-warmup", "--format", "plain"],
                          env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert ("step files' suffixes must be in lower case (.safetensors or .npz): ardiff does not read STEP.NPZ, "
            "step_000000.SAFETENSORS (STEP.NPZ has no step number either), so their steps would be left out of the "
            "episode\n") in proc.stderr, proc.stderr
    hint = next(line for line in proc.stderr.splitlines() if line.startswith("hint: rename them: "))
    renames, then = hint.removeprefix("hint: rename them: ").split("; then ", 1)
    assert then == "name each one without a number by its step (step_000001.npz)", hint
    subprocess.run(renames, shell=True, executable="/bin/bash", check=True)
    (folder / "STEP.npz").rename(folder / "step_000001.npz")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(tmp_path / "run"),
                           "--no-warmup", "--format", "plain"], env=cli_env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ok_steps(tmp_path / "run") == {("arm", 0), ("arm", 1)}


def _checkpoint_for_another_geometry(path: Path) -> Path:
    from pipelines.causal_world import Config, pipeline_class
    from pipelines.checkpoint import write_fresh_checkpoint

    return write_fresh_checkpoint(pipeline_class(), Config.from_dict({"preset": "tiny"}, where="test"), path)


def _pickled_checkpoint(path: Path) -> Path:
    import torch

    torch.save({"transformer.patch_embedding.weight": torch.zeros(1)}, path)
    return path


# config text (``{dir}`` is its folder) -> (command, [message parts], hint part)
# what makes a frame fewer tokens, in fields a config sets (it said "or raise the pipeline's max_model_len", which no
# config can change)
FRAME_HINT = ("lower the frame size (tokens per latent frame): a smaller 'model.height' or 'model.width', or a larger "
              "'model.vae_stride' or 'model.patch_size'")
CONFIG_CASES = {
    "unknown_key": ("pipelin: dreamzero\n", "inspect-capacity",
                    ["{config}: unknown key 'pipelin' (did you mean 'pipeline'?)"], "valid top-level keys"),
    "model_key_at_top_level": ("pipeline: dreamzero\npreset: tiny\n", "inspect-capacity",
                               ["{config}: unknown key 'preset' (did you mean 'model.preset'? the pipeline's "
                                "settings go under `model:`)"], "valid top-level keys"),
    "runtime_key_at_top_level": ("pipeline: dreamzero\nmemory_budget: 1GiB\n", "inspect-capacity",
                                 ["{config}: unknown key 'memory_budget' (did you mean 'runtime.memory_budget'? "
                                  "runtime settings go under `runtime:`)"], "valid top-level keys"),
    "unknown_key_and_pipeline": ("pipeline: dreamzeroo\npreset: tiny\n", "inspect-capacity",
                                 ["{config}: unknown key 'preset'"], "valid top-level keys"),
    "unknown_model_key": ("pipeline: dreamzero\nmodel: {preset: tiny, window_frame: 3}\n", "inspect-capacity",
                          ["{config}: unknown key 'model.window_frame' (did you mean 'window_frames'?)"],
                          "valid keys: preset"),
    "unknown_runtime_key": ("pipeline: dreamzero\nruntime: {sesion_capacity: 2}\n", "inspect-capacity",
                            ["{config}: unknown key 'runtime.sesion_capacity' (did you mean 'session_capacity'?)"],
                            "valid runtime keys"),
    "runtime_key_not_a_string": ("pipeline: dreamzero\nruntime: {5: x, null: y}\n", "inspect-capacity",
                                 ["{config}: unknown key 'runtime.5'"], "valid runtime keys"),
    "empty_file": ("# only a comment\n", "inspect-capacity", ["{config}: the config is empty (no YAML mapping in it)"],
                   "pipeline: NAME"),  # it read 'a config must be a YAML mapping, got NoneType'
    "a_list": ("- pipeline: dreamzero\n", "inspect-capacity", ["{config}: a config must be a YAML mapping, got list"],
               "starting with `pipeline: NAME`"),
    "empty_list_as_model": ("pipeline: dreamzero\nmodel: []\n", "inspect-capacity",
                            ["{config}: field 'model': expected a mapping, got []"], "set 'model' to a mapping"),
    "false_as_runtime": ("pipeline: dreamzero\nruntime: false\n", "inspect-capacity",
                         ["{config}: field 'runtime': expected a mapping, got False"], "set 'runtime' to a mapping"),
    # PyYAML reads YAML 1.1, where 1e30 (no dot, no sign in the exponent) is text: "expected a number, got '1e30'"
    # was all it said, which reads as a contradiction
    "exponent_without_a_dot": ("pipeline: dreamzero\nmodel: {guidance_scale: 1e30}\n", "inspect-capacity",
                               ["{config}: field 'model.guidance_scale': expected a number, got '1e30'"],
                               "takes '1e30' for text, not a number: write 1.0e+30"),
    "exponent_in_an_integer": ("pipeline: dreamzero\nruntime: {session_capacity: 1e3}\n", "inspect-capacity",
                               ["{config}: field 'runtime.session_capacity': expected a positive integer up to 2147483647, got '1e3'"],
                               "takes '1e3' for text, not a number: write 1000"),
    # past what an int holds exactly, the exponent form: str(int(1e30)) is 1000000000000000019884624838656, a number
    # other than the one the user wrote
    "huge_exponent_in_an_integer": ("pipeline: dreamzero\nruntime: {session_capacity: 1e30}\n", "inspect-capacity",
                                    ["{config}: field 'runtime.session_capacity': expected a positive integer up to "
                                     "2147483647, got '1e30'"], "takes '1e30' for text, not a number: write 1.0e+30"),
    # float() takes 'nan', YAML reads it as text (its own is .nan): no quotes to remove
    "nan_as_text": ("pipeline: dreamzero\nmodel: {guidance_scale: nan}\n", "inspect-capacity",
                    ["{config}: field 'model.guidance_scale': expected a number, got 'nan'"],
                    "set 'model.guidance_scale' to a number"),
    "quoted_number": ("pipeline: dreamzero\nmodel: {guidance_scale: '5'}\n", "inspect-capacity",
                      ["{config}: field 'model.guidance_scale': expected a number, got '5'"],
                      "'5' is text (quoted), not a number: remove the quotes"),
    "digits_of_another_script": ("pipeline: dreamzero\nmodel: {guidance_scale: \u0661\u0662}\n", "inspect-capacity",
                                 ["{config}: field 'model.guidance_scale': expected a number, got '\u0661\u0662'"],
                                 "set 'model.guidance_scale' to a number"),  # not "remove the quotes": there are none
    "infinite_float": ("pipeline: dreamzero\nmodel: {guidance_scale: .inf}\n", "inspect-capacity",
                       ["{config}: field 'model.guidance_scale': expected a finite number, got inf"],
                       "set 'model.guidance_scale' to a finite number"),
    "nan_float": ("pipeline: dreamzero\nmodel: {guidance_scale: .nan}\n", "inspect-capacity",
                  ["{config}: field 'model.guidance_scale': expected a finite number, got nan"],
                  "set 'model.guidance_scale' to a finite number"),
    "infinite_eps": ("pipeline: causal_world\nmodel: {eps: .inf}\n", "inspect-capacity",
                     ["{config}: field 'model.eps': expected a finite number, got inf"], "set 'model.eps'"),
    "int_beyond_float": ("pipeline: causal_world\nmodel: {timestep_shift: 1" + "0" * 400 + "}\n", "inspect-capacity",
                         ["{config}: field 'model.timestep_shift': expected a finite number, got 1000"], None),
    "num_threads_beyond_any_host": ("pipeline: dreamzero\nruntime: {num_threads: 100000}\n", "inspect-capacity",
                                    ["{config}: field 'runtime.num_threads': expected a positive integer up to 1024 "
                                     "(CPU threads) or null, got 100000"], "set 'runtime.num_threads'"),
    "num_threads_beyond_int64": ("pipeline: dreamzero\nruntime: {num_threads: " + str(10**30) + "}\n",
                                 "inspect-capacity", ["{config}: field 'runtime.num_threads': expected a positive "
                                                      "integer up to 1024 (CPU threads) or null, got " + str(10**30)],
                                 "set 'runtime.num_threads'"),
    "sampler_steps_that_never_end": ("pipeline: dreamzero\nmodel: {num_inference_steps: 100000000}\n",
                                     "inspect-capacity", ["{config}: field 'model.num_inference_steps': expected an "
                                                          "integer from 1 to 1000, got 100000000"], None),
    "layers_no_host_could_hold": ("pipeline: causal_world\ncheckpoint: null\nmodel: {preset: tiny, num_layers: "
                                  + str(10**12) + "}\n", "warmup",
                                  ["no built-in checkpoint for this causal_world geometry (5.06e+16 parameters)"],
                                  "set checkpoint: to a .safetensors file"),
    "int_beyond_int64": ("pipeline: dreamzero\nmodel: {ffn_dim: " + str(10**30) + "}\n", "warmup",
                         ["{config}: field 'model.ffn_dim': expected an integer below 2**63, got " + str(10**30)],
                         "set 'model.ffn_dim'"),
    "fractional_bytes": ("pipeline: dreamzero\nruntime: {memory_budget: 1.5}\n", "inspect-capacity",
                         ["{config}: field 'runtime.memory_budget': expected a byte size such as 536870912 or "
                          "'512MiB', got 1.5"], None),
    # past 16EiB: it said "expected a byte size such as 536870912 or '512MiB', got 1.9e+19", which is one
    "bytes_past_16eib": ("pipeline: dreamzero\nruntime: {memory_budget: 1.9e+19}\n", "inspect-capacity",
                         ["{config}: field 'runtime.memory_budget': expected a byte size of at most 16EiB, all that a "
                          "64-bit address space holds, got 1.9e+19"], "set 'runtime.memory_budget' to a byte size of "
                                                                     "at most 16EiB"),
    "bytes_past_16eib_as_text": ("pipeline: dreamzero\nruntime: {memory_budget: 17EiB}\n", "inspect-capacity",
                                 ["{config}: field 'runtime.memory_budget': expected a byte size of at most 16EiB, all "
                                  "that a 64-bit address space holds, got '17EiB'"], None),
    "wrong_type": ("pipeline: dreamzero\nmodel: {preset: tiny, num_layers: two}\n", "inspect-capacity",
                   ["{config}: field 'model.num_layers': expected an integer, got 'two'"],
                   "set 'model.num_layers' to an integer"),
    "out_of_range": ("pipeline: dreamzero\nruntime: {gpu_memory_fraction: 1.5}\n", "inspect-capacity",
                     ["{config}: field 'runtime.gpu_memory_fraction': expected a number in (0, 1], got 1.5"],
                     "set 'runtime.gpu_memory_fraction'"),
    "unknown_preset": ("pipeline: dreamzero\nmodel: {preset: tinny}\n", "inspect-capacity",
                       ["{config}: field 'model.preset': unknown preset 'tinny' (did you mean 'tiny'?)"],
                       "valid presets"),
    "unknown_pipeline": ("pipeline: dreamzeroo\n", "inspect-capacity",
                         ["{config}: field 'pipeline': unknown pipeline 'dreamzeroo' (did you mean 'dreamzero'?)"],
                         "registered pipelines: causal_world, dreamzero"),
    "class_in_config": ("pipeline: faulty_pipelines:FaultyDreamZero\n", "inspect-capacity",
                        ["{config}: field 'pipeline': 'faulty_pipelines:FaultyDreamZero' is not a registered "
                         "pipeline; a config names registered pipelines only"], "--pipeline MODULE:CLASS"),
    # inspect-capacity plans it (a cluster's checkpoint): test_inspect_capacity_devices.py
    "missing_checkpoint": ("pipeline: dreamzero\ncheckpoint: weights/missing.safetensors\n", "warmup",
                           ["{config}: field 'checkpoint': file not found: {dir}/weights/missing.safetensors"],
                           "checkpoint: null"),
    "checkpoint_is_a_folder": ("pipeline: dreamzero\ncheckpoint: weights\n", "inspect-capacity",  # 'file not found'
                               ["{config}: field 'checkpoint': a folder, not a file: {dir}/weights"],
                               "checkpoint: null"),
    # YAML's "\0" escape: os.stat raised ValueError ("embedded null byte"), a traceback as a bug in ardiff
    "checkpoint_holding_a_nul": ('pipeline: dreamzero\ncheckpoint: "model\\0.safetensors"\n', "inspect-capacity",
                                 ["{config}: field 'checkpoint': cannot look at {dir}/model\\x00.safetensors: it holds "
                                  "a NUL character, which no file name can"], "check the path"),
    "mismatched_checkpoint": ("pipeline: dreamzero\ncheckpoint: world.safetensors\nmodel: {preset: tiny}\n",
                              "warmup", ["checkpoint {dir}/world.safetensors (written for pipeline 'causal_world') "
                                         "does not match the model config:", "missing keys:", "; 1 shape mismatch: "],
                              "python -m pipelines.checkpoint init"),
    "pickled_checkpoint": ("pipeline: dreamzero\ncheckpoint: pickled.safetensors\n", "warmup",
                           ["cannot read checkpoint {dir}/pickled.safetensors: it is a torch.save file (a zip "
                            "holding a pickle), not safetensors"],
                           "pickled checkpoints are never loaded"),
    "invalid_yaml": ("pipeline: [dreamzero\n", "inspect-capacity",
                     ["{config}: not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"],
                     "check the indentation"),
    # an editor's tab in the indentation (or after a colon) was told only to check the indentation, quotes and brackets
    "tab_indent": ("pipeline: dreamzero\nmodel:\n\tpreset: tiny\n", "inspect-capacity",
                   ["{config}: not valid YAML at line 3, column 1: found character '\\t' that cannot start any token"],
                   "YAML indents with spaces, never tabs: replace the tab at line 3, column 1 with spaces"),
    "tab_after_colon": ("pipeline: dreamzero\nmodel:\n  preset:\ttiny\n", "warmup",
                        ["{config}: not valid YAML at line 3, column 10: found character '\\t'"],
                        "YAML indents with spaces, never tabs: replace the tab at line 3, column 10 with spaces"),
    # 20 MB of comments took 18 s before it was read as nothing; a 300k-item list 20 s, to say "unknown key"
    "too_large": ("pipeline: dreamzero\n" + "# a comment\n" * 6000, "inspect-capacity",
                  ["{config}: more than 64 KiB, which no config is: is it the config?"], "pass a config YAML"),
    # a character the YAML reader refuses had no line or column, and PyYAML's "<unicode string>"
    "control_character": ("pipeline: dreamzero\nruntime:\n  device: \"cp\x1bu\"\n", "inspect-capacity",
                          ["{config}: not valid YAML at line 3, column 14: unacceptable character #x001b: special "
                           "characters are not allowed"], "check the indentation"),
    "duplicate_key": ("pipeline: dreamzero\nruntime: {device: cpu}\nmodel: {preset: tiny}\n"
                      "runtime: {dtype: bfloat16}\n", "inspect-capacity",
                      ["{config}: key 'runtime' is given twice (lines 2 and 4)"],
                      "merge the two"),
    "duplicate_nested_key": ("pipeline: dreamzero\nmodel: {dim: 64, num_layers: 2, dim: 128}\n", "inspect-capacity",
                             ["{config}: key 'model.dim' is given twice (line 2, columns 9 and 33)"], "merge the two"),
    "python_tag": ("pipeline: !!python/name:os.system dreamzero\n", "inspect-capacity",
                   ["{config}: not valid YAML at line 1, column 11: could not determine a constructor for the tag "
                    "'tag:yaml.org,2002:python/name:os.system'"], None),
    # The offending byte, by its offset and value: the first one that is not UTF-8 (not the one after it).
    "not_utf8": (b"pipeline: dreamzero\n\xff\xfe\n", "inspect-capacity",
                 ["{config}: not UTF-8 text (byte 20: b'\\xff')"], "save the config as UTF-8"),
    "nested_too_deeply": ("pipeline: dreamzero\nmodel: {patch_size: " + "[" * 5000 + "]" * 5000 + "}\n",
                          "inspect-capacity", ["{config}: lists or mappings are nested too deeply to read"],
                          "runaway brackets"),
    "number_too_long": ("pipeline: dreamzero\nmodel: {dim: " + "9" * 5000 + "}\n", "inspect-capacity",
                        ["{config}: cannot read a value: Exceeds the limit (4300 digits) for integer string "
                         "conversion"], "quote the value"),
    "impossible_date": ("pipeline: dreamzero\nruntime: {device: 2024-13-45}\n", "inspect-capacity",
                        ["{config}: cannot read a value: month must be in 1..12"], "quote the value"),
    "window_beyond_max_model_len": ("pipeline: causal_world\nmodel: {preset: tiny, window_frames: 100000}\n", "warmup",
                                    ["{config}: field 'model.window_frames': one attention call can see 1600097 "
                                     "tokens (sink + window + block + scratch), more than max_model_len=1048576 "
                                     "(sink_frames=3, window_frames=100000, frames_per_block=3, 16 tokens per frame, "
                                     "1 register token)"], "lower 'model.window_frames' to at most 65529"),
    # The field that brings most of the tokens is named (it was always window_frames), or the frame size.
    "block_beyond_max_model_len": ("pipeline: causal_world\nmodel: {preset: tiny, frames_per_block: 100000}\n",
                                   "inspect-capacity", ["{config}: field 'model.frames_per_block': one attention call "
                                                        "can see", "frames_per_block=100000, 16 tokens per frame"],
                                   "lower 'model.frames_per_block' to at most 65526"),
    "frame_beyond_max_model_len": ("pipeline: causal_world\nmodel: {preset: tiny, height: 65536, width: 65536}\n",
                                   "inspect-capacity", ["{config}: one attention call can see",
                                                        "67108864 tokens per frame"],
                                   FRAME_HINT),
    # A frame of max_model_len tokens, or of half of it: no window or block fits, yet 'model.window_frames' (the most
    # frames) was named, and lowering it to 1 left the call 3 frames long.
    "frame_no_window_fits": ("pipeline: causal_world\nmodel: {preset: tiny, height: 8192, width: 8192}\n",
                             "inspect-capacity", ["Error: {config}: one attention call can see 12582913 tokens",
                                                  "1048576 tokens per frame"],
                             FRAME_HINT),
    "half_frame_no_window_fits": ("pipeline: causal_world\nmodel: {preset: tiny, height: 4096, width: 8192}\n",
                                  "inspect-capacity", ["Error: {config}: one attention call can see 6291457 tokens",
                                                       "524288 tokens per frame"],
                                  FRAME_HINT),
    # 2**62 actions are as many register tokens: "lower the pipeline's register tokens per branch" named no field
    "action_horizon_beyond_max_model_len": (f"pipeline: dreamzero\nmodel: {{preset: tiny, action_horizon: {2**62}}}\n",
                                            "inspect-capacity",
                                            ["{config}: field 'model.action_horizon': expected a positive integer "
                                             f"below max_model_len=1048576 (one attention call sees every action "
                                             f"token and the state token), got {2**62}"],
                                            "set 'model.action_horizon'"),
    "device_index_not_a_number": ("pipeline: dreamzero\nruntime: {device: 'cuda:x'}\n", "inspect-capacity",
                                  ["{config}: field 'runtime.device': expected auto, cpu, cuda or cuda:N (N from 0 "
                                   "to 127), got 'cuda:x'"], "set 'runtime.device'"),
    "device_index_not_ascii": ("pipeline: dreamzero\nruntime: {device: 'cuda:\u0661'}\n", "inspect-capacity",
                               ["{config}: field 'runtime.device': expected auto, cpu, cuda or cuda:N (N from 0 "
                                "to 127), got 'cuda:\u0661'"], "set 'runtime.device'"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_case_message(tmp_path, case):
    text, command, parts, hint = CONFIG_CASES[case]
    if case == "mismatched_checkpoint":
        _checkpoint_for_another_geometry(tmp_path / "world.safetensors")
    if case == "checkpoint_is_a_folder":
        (tmp_path / "weights").mkdir()
    if case == "pickled_checkpoint":
        _pickled_checkpoint(tmp_path / "pickled.safetensors")
    config = tmp_path / f"{case}.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    extra = ["--device", "cpu"] if command == "warmup" else []
    result = runner.invoke(app, [command, str(config), *extra, "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    for part in parts:
        assert part.format(config=config, dir=tmp_path) in result.stderr
    if hint is not None:
        assert re.search(r"^hint: .*" + re.escape(hint), result.stderr, re.M), result.stderr


def test_a_checkpoint_of_another_pipeline_is_named_by_counts_and_first_keys_and_verbose_lists_every_key(tmp_path):
    """A tiny checkpoint given to a larger config named every key it lacked: a 48 KB error line for
    lingbot-world-14b. The error counts each kind and names the first few; --verbose prints one line per key."""
    _checkpoint_for_another_geometry(tmp_path / "world.safetensors")
    config = tmp_path / "dreamzero.yaml"
    config.write_text(CONFIG_CASES["mismatched_checkpoint"][0])
    args = ["warmup", str(config), "--device", "cpu", "--format", "plain"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) < 1500, error[:300]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (missing keys|unexpected keys|shape mismatch): ", error)}
    assert counts["missing keys"] > 3 and re.search(r"and \d+ more.* \(--verbose lists them all\)$", error), error
    assert counts["shape mismatch"] == 1, error  # one, not "1 shape mismatches"
    result = runner.invoke(app, [*args, "--verbose"])
    assert result.exit_code == 2, result.stderr
    listed = re.findall(r"^debug: (missing key|unexpected key|shape mismatch): ", result.stderr, re.M)
    assert {kind: listed.count(kind) for kind in set(listed)} == {
        kind.removesuffix("es").removesuffix("s"): n for kind, n in counts.items()}


def test_a_byte_size_with_an_exponent_reads_the_same_in_a_config_as_on_the_command_line(tmp_path):
    """YAML 1.1 reads `memory_budget: 1e3` as text, where a number field refuses it (`session_capacity: 1e3`); a byte
    size takes text ('512MiB'), so it is 1000 bytes, as `--memory-budget 1e3` and YAML's float `1.0e+3` are."""
    needs = "one session needs 291.00 KiB (297984 bytes) of KV cache but only 1000 B (1000 bytes) is available"
    for budget, option in (("1e3", []), ("1.0e+3", []), ("null", ["--memory-budget", "1e3"])):
        config = tmp_path / "budget.yaml"
        config.write_text(f"pipeline: dreamzero\nruntime: {{memory_budget: {budget}}}\n")
        result = runner.invoke(app, ["inspect-capacity", str(config), "--format", "plain", *option])
        assert result.exit_code == 3 and needs in result.stderr, (budget, result.stderr)


# A byte size as a user types it: a plain number, as the number options take it, and a unit after one space or none.
# Python's int() and float() read more, which was taken: '1_000', spaces and a line break around it (a line read with
# its newline), other scripts' digits ('\uff11', a wide 1), and any spaces inside ('1G B' was 1GB).
NOT_PLAIN_BYTE_SIZES = ["1_000", "1_000MiB", " 1GiB", "1GiB\n", "1GiB ", "\uff11GiB", "1  GiB", "1G B", "1\tGiB"]


@pytest.mark.parametrize("args", [["inspect-capacity", "--memory-budget"], ["inspect-capacity", "--available"],
                                  ["warmup", "--memory-budget"], ["rollout", "--memory-budget"],
                                  ["rollout", "--swap-space"]], ids=lambda args: f"{args[0]} {args[1]}")
def test_a_byte_size_option_takes_a_plain_number_and_a_unit_as_typed(cli_env, args):
    """`--memory-budget 1_000` was 1000 bytes and `--swap-space ' 2GiB'` 2GiB, where `--session-capacity 1_000` is a
    usage error: each value is refused naming the option, the value and what a byte size is."""
    for value in NOT_PLAIN_BYTE_SIZES:
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, value, "--format", "plain"],
                              capture_output=True, text=True, env=cli_env, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", (value, proc.stderr)
        error = proc.stderr.splitlines()[0]
        assert error.startswith(f"Error: Invalid value for '{args[1]}': cannot read {quoted(value)} as a byte "
                                "size: "), (value, error)
        assert "ASCII digits" in error and "KiB .. EiB" in error, (value, error)


@pytest.mark.parametrize(("value", "expected"), [
    ("007", 7), ("+5", 5), ("1e3", 1000), ("2.0", 2), ("1.5GiB", 3 << 29), ("2 GiB", 2 << 30), ("1.5 gb", 15 * 10**8),
    (".5K", 512), ("16EiB", 2**64),
    # exactly as typed, not as a float rounds it: a float reads 0.99..9 as 1, so it was 1024 bytes
    ("0.999999999999999999999999999999999KiB", 1023), ("9007199254740993", 2**53 + 1),
])
def test_a_byte_size_option_reads_a_plain_number_exactly(cli_env, value, expected):
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "--available", value,
                           "--format", "json"], capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode in (0, 3), proc.stderr  # 3: too small for one session, with the plan's figures all the same
    if proc.returncode == 0:
        assert json.loads(proc.stdout.splitlines()[0])["plan"]["available_bytes"] == expected
    else:
        assert f"({expected} bytes) is available" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("args", "why"), [
    (["--memory-budget", "1e-400"], "a byte size without a unit is a whole number of bytes, got '1e-400'"),
    # a float read it as 0 bytes: "must be positive"; as --swap-space, 0 turned swapping off
    (["--memory-budget", "1e-400GiB"], "cannot read '1e-400GiB' as a byte size: less than one byte"),
    (["--swap-space", "0.0001K"], "cannot read '0.0001K' as a byte size: less than one byte"),
    (["--memory-budget", "1e9999999999999999999GiB"], "cannot read '1e9999999999999999999GiB' as a byte size: too "
                                                      "large (at most 16EiB"),
    (["--memory-budget", "-1e400"], "a byte size must be positive, got '-1e400'"),
    (["--swap-space", "-1KiB"], "a byte size must be >= 0, got '-1KiB'"),
    (["--memory-budget", "-inf"], "cannot read '-inf' as a byte size: not a finite number"),
    (["--memory-budget", "NaN GiB"], "cannot read 'NaN GiB' as a byte size: not a finite number"),
    (["--memory-budget", "1.5"], "a byte size without a unit is a whole number of bytes, got '1.5'"),
])
def test_a_byte_size_option_out_of_range_says_why(cli_env, args, why):
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *args, "--format", "plain"],
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"Error: Invalid value for '{args[0]}': {why}"), proc.stderr


@pytest.mark.parametrize(("args", "why"), [
    (["warmup", "--memory-budget", "0"], "a byte size must be positive, got '0'"),
    (["inspect-capacity", "--available", "-4GiB"], "a byte size must be positive, got '-4GiB'"),
    (["inspect-capacity", "--memory-budget", "-1"], "a byte size must be positive, got '-1'"),
    (["rollout", "--swap-space", "-1KiB"], "a byte size must be >= 0, got '-1KiB'"),
])
def test_a_byte_size_option_below_its_range_says_what_to_give(cli_env, args, why):
    """A size of 0 or less said only what it must be, and its hint was the command's --help: every other byte size
    error says what to write (`use a whole number of bytes, ... such as 512MiB`); so does this one now. --swap-space's
    said `(use a byte size of 0 (none) or more, ...)`: a parenthesis inside the one the usage error puts it in."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--format", "json"],
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)
    least = "0 or more" if args[1] == "--swap-space" else "1 byte or more"
    assert error["message"] == (f"Invalid value for '{args[1]}': {why} (use a byte size of {least}, such as 512MiB "
                                "or 2GiB)"), error


def test_a_byte_size_in_a_config_is_yamls_number_or_text_read_as_the_command_line_reads_it(tmp_path):
    """Unquoted, `1_000` is YAML 1.1's int 1000, a number as the config wrote it; quoted, it is text, read as
    `--memory-budget` reads it: '1_000 MiB' was 1000MiB."""
    config = tmp_path / "budget.yaml"
    config.write_text("pipeline: dreamzero\nruntime: {memory_budget: 1_000}\n")
    result = runner.invoke(app, ["inspect-capacity", str(config), "--format", "plain"])
    assert result.exit_code == 3 and "but only 1000 B (1000 bytes) is available" in result.stderr, result.stderr
    for text in ("'1_000 MiB'", "' 512MiB'", '"512MiB\\n"', "'1G B'"):
        config.write_text(f"pipeline: dreamzero\nruntime: {{memory_budget: {text}}}\n")
        result = runner.invoke(app, ["inspect-capacity", str(config), "--format", "plain"])
        assert result.exit_code == 2, (text, result.stderr)
        error, hint = result.stderr.splitlines()[:2]
        assert error.startswith(f"Error: {config}: field 'runtime.memory_budget': expected a byte size such as "
                                "536870912 or '512MiB', got '"), (text, error)
        assert hint.startswith("hint: cannot read ") and "ASCII digits" in hint, (text, hint)


def test_auto_as_a_byte_size_in_a_config_says_to_leave_it_out(tmp_path):
    """`memory_budget: auto` (as `device: auto`) said "no number before 'auto'", as if a number were missing, which
    --memory-budget auto no longer says."""
    config = tmp_path / "auto.yaml"
    config.write_text("pipeline: dreamzero\nruntime: {memory_budget: auto}\n")
    result = runner.invoke(app, ["inspect-capacity", str(config), "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.splitlines()[1] == (
        "hint: auto is no byte size: leave memory_budget out, or null, for its default (free device memory, host "
        "memory on CPU), or write a byte size such as 512MiB"), result.stderr


def test_a_config_name_too_long_for_the_system_is_named_with_its_error():
    name = "a" * 300  # ENAMETOOLONG: it was "a bug in ardiff"
    result = runner.invoke(app, ["inspect-capacity", name, "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr == f"Error: cannot look at CONFIG {name}: File name too long\nhint: check the path\n"


@pytest.mark.parametrize(("target", "message", "hint"), [
    ("missing.yaml", "config {config} is a link to {target}, which does not exist",
     "mount or restore what it links to"),
    ("c.yaml", "cannot look at CONFIG {config}: Too many levels of symbolic links", "check the links on its path"),
])
def test_a_config_that_is_a_dangling_link_or_a_link_loop_says_so(tmp_path, target, message, hint):
    # "config file not found: c.yaml" with "did you mean 'c.yaml'?", the file's own name; a loop: the same
    config = tmp_path / "c.yaml"
    config.symlink_to(tmp_path / target)
    result = runner.invoke(app, ["inspect-capacity", str(config), "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    said = f"Error: {message.format(config=config, target=tmp_path / target)}\nhint: {hint}"
    assert result.stderr.startswith(said) and "did you mean" not in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["rollout", "warmup"])
def test_a_window_no_attention_call_can_see_is_refused_before_weights_demo_episodes_or_out_are_made(
        tmp_path, monkeypatch, command):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / "cache"))  # where weights and demo episodes would go
    config = tmp_path / "window.yaml"
    config.write_text(CONFIG_CASES["window_beyond_max_model_len"][0])
    out = ["--out", str(tmp_path / "out")] if command == "rollout" else []
    result = runner.invoke(app, [command, str(config), *out, "--device", "cpu", "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert f"Error: {config}: field 'model.window_frames': one attention call can see" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["window.yaml"]  # no cache, no out


@pytest.mark.parametrize(("command", "checkpoint"), [("warmup", False), ("rollout", False), ("warmup", True)])
def test_a_weight_too_large_for_torch_is_a_config_error_naming_the_field(tmp_path, command, checkpoint):
    """`cond_dim: 2**62` makes a weight torch cannot size even on the meta device: warmup ended "from_config() failed:
    RuntimeError: Storage size calculation overflowed" (exit 1, blamed on the pipeline), rollout with a traceback.
    With or without `checkpoint:`, it is the config's mistake, named before --out or the demo episodes are made."""
    (tmp_path / "w.safetensors").write_bytes(b"\x00" * 8)  # never read: the model is refused before its weights
    config = tmp_path / "huge.yaml"
    config.write_text(f"pipeline: causal_world\ncheckpoint: {'w.safetensors' if checkpoint else 'null'}\n"
                      f"model: {{preset: tiny, cond_dim: {2**62}}}\n")
    out = ["--out", str(tmp_path / "out")] if command == "rollout" else []
    env = {**os.environ, "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, str(config), *out, "--device", "cpu",
                           "--format", "plain"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert (f"Error: the causal_world model is too large for torch: 'model.cond_dim' ({2**62}) makes a weight of "
            f"shape [64, {2**62}], 2**63 bytes or more") in proc.stderr, proc.stderr
    assert "hint: lower 'model.cond_dim'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.yaml", "w.safetensors"]  # no cache, no out


@pytest.mark.parametrize(("fields", "said"), [
    # the seed holds the same size but makes no weight: it was named with cond_dim ("... and ... make a weight")
    ({"seed": 2**62, "cond_dim": 2**62}, f"'model.cond_dim' ({2**62}) makes a weight of shape [64, {2**62}]"),
    ({"text_dim": 2**62, "cond_dim": 2**62},
     f"'model.text_dim' and 'model.cond_dim' ({2**62} each) are each too large alone; one makes a weight of shape"),
    # the seed's trial (dim back at its default of 64) is refused, num_heads 64 leaving heads of 1: it was said "too
    # large alone" and its lowering hinted; only dim is known to be
    ({"dim": 2**62, "num_heads": 64, "seed": 2**62}, f"'model.dim' ({2**62}) makes a weight of shape [{2**62}, "),
    # none known alone: height and width fit with the stride at its default; the stride's trial (the height at its
    # default, no multiple of it) is refused. It was named alone, said to make the weight, as if tried
    ({"patch_size": [1, 1, 1], "height": 2**62, "width": 2**62, "vae_stride": 2**62},
     f"one or more of 'model.height' and 'model.width' and 'model.vae_stride' ({2**62} each) make a weight of shape"),
])
def test_a_weight_too_large_for_torch_names_only_the_fields_too_large(tmp_path, fields, said):
    config = tmp_path / "huge.yaml"
    config.write_text("pipeline: causal_world\nmodel: " + json.dumps({"preset": "tiny", **fields}) + "\n")
    env = {**os.environ, "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", str(config), "--device", "cpu",
                           "--format", "plain"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"Error: the causal_world model is too large for torch: {said}" in proc.stderr, proc.stderr
    named = [name for name in fields if f"'model.{name}'" in said]
    assert f"hint: lower {' or '.join(repr('model.' + name) for name in named)}\n" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("text", "said"), [
    ("pipeline: dreamzero\nmodel:\n  preset: tiny\n  yes: 1\n",
     "unknown key 'model.True' (a key written yes, on or true, which YAML reads as true)"),
    ("pipeline: causal_world\nmodel: {preset: tiny, on: 1}\n",
     "unknown key 'model.True' (a key written yes, on or true, which YAML reads as true)"),
    ("pipeline: dreamzero\nruntime:\n  off: 1\n",
     "unknown key 'runtime.False' (a key written no, off or false, which YAML reads as false)"),
    ("pipeline: dreamzero\nno: 1\n", "unknown key False (a key written no, off or false, which YAML reads as false)"),
    ("pipeline: dreamzero\nmodel: {preset: tiny, ~: 1}\n",
     "unknown key 'model.None' (a key written null or ~, which YAML reads as null)"),
])
def test_a_key_yaml_reads_as_a_boolean_or_null_is_named_with_how_it_was_written(tmp_path, text, said):
    """YAML 1.1 reads a key `yes:` (or `on:`, `off:`, `~:`) as True, False or None: the error named 'model.True', a
    key nobody wrote."""
    assert_inspect_capacity_refuses(tmp_path, text, said)


def assert_inspect_capacity_refuses(tmp_path: Path, text: str, said: str) -> None:
    """`inspect-capacity` of a config holding ``text`` exits 2, its error ``said`` after the file's name."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--available", "8GiB",
                           "--format", "plain"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"Error: {config}: {said}\nhint: "), proc.stderr


@pytest.mark.parametrize(("text", "said"), [
    ("pipeline: dreamzero\nMODEL: {preset: tiny}\n", "unknown key 'MODEL' (did you mean 'model'?)"),
    ("pipeline: dreamzero\nmodel: {PRESET: tiny}\n", "unknown key 'model.PRESET' (did you mean 'preset'?)"),
    ("pipeline: dreamzero\nmodel: {preset: TINY}\n",
     "field 'model.preset': unknown preset 'TINY' (did you mean 'tiny'?)"),
    ("pipeline: DREAMZERO\n", "field 'pipeline': unknown pipeline 'DREAMZERO' (did you mean 'dreamzero'?)"),
])
def test_a_name_written_in_another_case_gets_a_did_you_mean(tmp_path, text, said):
    """`Model` was answered "did you mean 'model'?", but `MODEL`, `PRESET`, `TINY` and `DREAMZERO` got no suggestion:
    difflib finds no likeness between upper- and lower-case letters."""
    assert_inspect_capacity_refuses(tmp_path, text, said)


def _alias_bomb(depth: int = 9) -> str:
    """A flow list whose anchors nest ``depth`` deep, ten aliases each: 10**depth strings once expanded."""
    items = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, depth + 1)]
    return f"[{', '.join(items)}]"


# config text -> what the one Error line says (after the path)
ALIAS_CASES = {
    "billion_laughs_model": (f"pipeline: dreamzero\nmodel: {{dim: {_alias_bomb()}}}\n",
                             "field 'model.dim': expected an integer, got [['lol', 'lol',"),
    "billion_laughs_runtime": (f"pipeline: dreamzero\nruntime: {{memory_budget: {_alias_bomb()}}}\n",
                               "field 'runtime.memory_budget': expected a byte size"),
    "billion_laughs_preset": (f"pipeline: dreamzero\nmodel: {{preset: {_alias_bomb()}}}\n",
                              "field 'model.preset': unknown preset [['lol',"),
    "alias_in_its_own_anchor": ("pipeline: dreamzero\nmodel: {patch_size: &r [1, *r]}\n",
                                "field 'model.patch_size[1]': expected an integer, got [1, [1, [...]]]"),
}


@pytest.mark.parametrize("case", sorted(ALIAS_CASES))
def test_yaml_aliases_neither_hang_nor_flood_the_error(tmp_path, cli_env, case):
    """safe_load shares an alias's object, so building the data is cheap; reading the node graph for duplicate
    keys, and repr() of the value in the message, used to expand it (10**9 strings) or loop forever."""
    text, message = ALIAS_CASES[case]
    config = tmp_path / "bomb.yaml"
    config.write_text(text)
    result = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "plain"],
                            env=cli_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"Error: {config}: {message}" in result.stderr
    assert len(result.stderr) < 2000 and "Traceback" not in result.stderr


CLI_CASES = {
    "quiet_and_verbose": (["rollout", "--quiet", "--verbose"], "--quiet and --verbose contradict each other",
                          "pass one of them"),
    "idle_timeout_without_follow": (["rollout", "--idle-timeout", "5"],
                                    "--idle-timeout has no effect without --follow", "add --follow"),
    "resume_without_out": (["rollout", "--resume"], "--resume needs --out DIR",
                           "hint: the run printed it as 'outputs: DIR'"),
    "missing_episode_folder": (["rollout", "dreamzero-tiny", "no/such/episode"],
                               "episode folder not found: no/such/episode", "mkdir -p"),
    "malformed_pipeline": (["inspect-capacity", "--pipeline", "a:b:c"],
                           "--pipeline: expected MODULE:CLASS (dotted Python names), got 'a:b:c'", "--pipeline"),
    "missing_pipeline_module": (["inspect-capacity", "--pipeline", "no_such_module_xyz:Pipeline"],
                                "--pipeline: pipeline 'no_such_module_xyz:Pipeline': cannot import "
                                "'no_such_module_xyz': ModuleNotFoundError", "PYTHONPATH"),
    # A budget beyond the device is fine while the plan is small (the spec caps the sessions); a plan beyond it
    # would allocate and zero pools the host cannot hold.
    "plan_beyond_the_host": (["warmup", "--device", "cpu", "--memory-budget", "16EiB", "--session-capacity",
                              str(2**31 - 1)],
                             "the memory budget (16.00 EiB, 18446744073709551616 "
                             "bytes) plans 390.00 TiB of KV memory, more than this host's ", "leave the budget"),
    "empty_config_argument": (["inspect-capacity", ""], "CONFIG is an empty string", "omit it for the default"),
    "config_is_a_device": (["inspect-capacity", "/dev/null"], "config /dev/null is not a regular file",
                           "pass a YAML file"),
    "warmup_quiet_verbose": (["warmup", "-q", "-v"], "--quiet and --verbose contradict each other", None),
}


def test_a_folder_of_episodes_that_holds_none_is_a_usage_error_before_anything_is_made(tmp_path):
    """A folder whose only subfolders are hidden (.cache) or ardiff's own (ardiff-runs/, where a rollout without
    --out wrote) holds no episode: exit 2 naming it, before the model loads or --out is made."""
    robots = tmp_path / "robots"
    (robots / ".cache").mkdir(parents=True)
    (robots / "ardiff-runs" / "20250601-101500").mkdir(parents=True)
    (robots / "ardiff-runs" / "20250601-101500" / "results.jsonl").write_text("")
    out = tmp_path / "run"
    result = runner.invoke(app, ["rollout", "dreamzero-tiny", str(robots), "-o", str(out), "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr == (f"Error: no episode folders in {robots}\nhint: pass folders of step files "
                             "(step_000000.safetensors, ...); hidden folders and ardiff's own run folders are not "
                             "taken for episodes\n"), result.stderr
    assert "planned" not in result.stderr and not out.exists()


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_contradictory_or_invalid_options(case):
    args, message, hint = CLI_CASES[case]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.stderr
    assert f"Error: {message}" in result.stderr and "Traceback" not in result.stderr
    if hint is not None:
        assert hint in result.stderr


def test_a_fraction_of_all_the_memory_and_a_format_in_capitals_are_taken():
    """The bounds are (0, 1]: --gpu-memory-fraction 1 (all of it) is valid; --format, as every choice, takes any
    case (`--format JSON`)."""
    result = runner.invoke(app, ["inspect-capacity", "--gpu-memory-fraction", "1", "--format", "JSON"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["plan"]["gpu_memory_fraction"] == 1.0


def test_a_budget_beyond_the_device_whose_plan_fits_loads():
    """The spec caps dreamzero-tiny's sessions, so a 16EiB budget (the most a byte size may be) plans a few pages:
    nothing to refuse."""
    result = runner.invoke(app, ["warmup", "--device", "cpu", "--memory-budget", "16EiB", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["restored"] is True


def test_device_option_takes_an_index_and_refuses_what_is_not_a_device(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # cuda:1 is a visible GPU (only planned for, never used)
    for device in ("CUDA:1", "cuda:01", "cuda:00001"):  # cuda:01 was planned for GPU 1, and torch.device() refused it
        result = runner.invoke(app, ["inspect-capacity", "--device", device, "--available", "1GiB", "--format",
                                     "json"])
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["device"] == "cuda:1"
    # cuda:١ (an Arabic-Indic 1) and cuda:１ (a fullwidth 1) used to pass the check: inspect-capacity planned for
    # GPU 1 and warmup failed in torch.device() as "a bug in ardiff". The index is ASCII digits.
    for device in ("cuda:x", "cuda:\u0661", "cuda:\uff11", "cuda:128", "cuda:2147483648"):
        result = runner.invoke(app, ["inspect-capacity", "--device", device])
        assert result.exit_code == 2
        # Typer draws usage errors in a box
        unboxed = " ".join(re.sub("[│╭╮╰╯─]", " ", result.stderr).split())
        assert f"'{device}' is not a device: use auto, cpu, cuda or cuda:N" in unboxed, result.stderr


@pytest.mark.parametrize(("dtype", "canonical"), [("fp16", "float16"), ("half", "float16"), ("BF16", "bfloat16"),
                                                  ("fp32", "float32"), ("Float16", "float16")])
def test_dtype_and_device_take_the_same_spellings_in_a_config_and_on_the_command_line(tmp_path, dtype, canonical):
    """`runtime.dtype: fp16` used to load while `--dtype fp16` was refused, and `--device CPU` ran while
    `runtime.device: CPU` was refused: both read one normalisation now. So does the attention backend
    (`runtime.attention_backend: TORCH` was refused while `--attention-backend TORCH` ran)."""
    config = tmp_path / "spelled.yaml"
    config.write_text(f"pipeline: dreamzero\nmodel: {{preset: tiny}}\n"
                      f"runtime: {{dtype: {dtype}, device: CPU, attention_backend: TORCH}}\n")
    for args in ([str(config)], ["--dtype", dtype, "--device", "CPU", "--attention-backend", "TORCH"]):
        result = runner.invoke(app, ["inspect-capacity", *args, "--available", "1GiB", "--format", "json"])
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        assert (data["plan"]["dtype"], data["device"], data["attention"]["setting"]) == (canonical, "cpu", "torch")


def test_warmup_and_rollout_read_dtype_and_device_spellings_as_a_config_does(tmp_path):
    config = tmp_path / "spelled.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny}\nruntime: {device: CPU}\n")
    result = runner.invoke(app, ["warmup", str(config), "--dtype", "fp32", "--device", "Cpu", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout.splitlines()[-1])
    assert (data["dtype"], data["device"], data["restored"]) == ("float32", "cpu", True)
    (tmp_path / "run.json").write_text(json.dumps({"format": 1, "config": "dreamzero-tiny", "dtype": "float32",
                                                   "started": 1796379443.5, "episodes": [], "demo": True}))
    result = runner.invoke(app, ["rollout", "--resume", "--out", str(tmp_path), "--dtype", "half"])
    assert result.exit_code == 2  # compared by its canonical name
    assert result.stderr.endswith("Error: --dtype 'float16' differs from the run's 'float32'\n"
                                  "hint: resume with the same --dtype, or leave it out to reuse the recorded one\n")
    result = runner.invoke(app, ["inspect-capacity", "--dtype", "f64", "--format", "plain"])
    assert result.exit_code == 2
    unboxed = " ".join(re.sub("[│╭╮╰╯─]", " ", result.stderr).split())
    assert "'f64' is not a dtype: use float32, bfloat16 or float16" in unboxed, result.stderr


@pytest.mark.parametrize("where", ["a_file", "under_a_file", "a_pipe"])
def test_out_that_cannot_be_a_folder_is_refused_before_loading(tmp_path, where):
    (tmp_path / "a_file").write_text("not a folder")
    os.mkfifo(tmp_path / "a_pipe")
    out = tmp_path / "a_file" / "run" if where == "under_a_file" else tmp_path / where
    result = runner.invoke(app, ["rollout", "--out", str(out), "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    # it read "cannot create the output folder: File exists", of the file it named
    what = {"a_file": "it is a file", "under_a_file": f"{tmp_path / 'a_file'} is a file", "a_pipe": "it is a pipe"}
    assert (f"Error: --out {out}: {what[where]}, not a folder\n"
            "hint: choose a folder, or a path where none exists yet\n") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "planned" not in result.stderr  # the model never loaded


@pytest.mark.parametrize("where", ["the_link", "under_the_link"])
def test_out_that_is_a_link_to_nothing_names_the_link_before_loading(tmp_path, where):
    """`-o runs/eval1` where runs/eval1 (or runs) links to a scratch disk not mounted: the error read only "cannot
    create the output folder: File exists", with a hint to choose one that does not exist yet, of a path `ls` shows
    as nothing but a link. It names the link and where it points."""
    link = tmp_path / "scratch"
    link.symlink_to(tmp_path / "not-mounted")
    out = link if where == "the_link" else link / "eval1"
    result = runner.invoke(app, ["rollout", "--out", str(out), "--format", "plain"])
    assert result.exit_code == 2, result.stderr
    assert (f"Error: --out {out}: cannot create the output folder: File exists ({link} is a link to "
            f"{tmp_path / 'not-mounted'}, which does not exist)\n"
            "hint: create the folder it links to (a disk not mounted?), or remove the link\n") in result.stderr, \
        result.stderr
    assert "Traceback" not in result.stderr and "planned" not in result.stderr  # the model never loaded
    assert not (tmp_path / "not-mounted").exists()


@pytest.mark.parametrize("where", ["another_episode", "an_episode_of_the_run", "the_folder_of_episodes",
                                   "the_folder_of_the_episode", "inside_an_episode_of_the_folder_given",
                                   "inside_the_episode_given"])
def test_out_that_is_an_episode_folder_is_refused_and_left_as_it_was(tmp_path, cli_env, where):
    # `-o data/b` typed for `data/b` (or `-o data` for `data`): the run's files used to be written among the step
    # files, and the folder, now holding a run, was no longer taken for an episode by `rollout CFG data/` (skipped
    # without a word). `-o data` for `data/a`: the run was written among the episodes, and `rollout CFG data/` then
    # failed an episode 'episodes' (the run's outputs folder) with exit 4. `-o data/a/out`: the run's folder went
    # wherever data/a went (a recorder publishing it by renaming data/a.part to data/a, with --follow, took it away
    # mid-run: the run stopped at its next write, its later steps never ran).
    data = tmp_path / "data"
    for name in ("a", "b"):
        frame = np.zeros((16, 16, 3), np.uint8)
        write_episode(data / name, [{"exterior_image_0": frame, "exterior_image_1": frame, "wrist_image": frame,
                                     "joint_position": np.zeros(7, np.float32),
                                     "gripper_position": np.zeros(1, np.float32)}], prompt="p")
    out, episode = {"another_episode": ("data/b", "data/a"), "an_episode_of_the_run": ("data/a", "data/a"),
                    "the_folder_of_episodes": ("data", "data"), "the_folder_of_the_episode": ("data", "data/a"),
                    "inside_an_episode_of_the_folder_given": ("data/a/out", "data"),
                    "inside_the_episode_given": ("data/a/runs/eval1", "data/a")}[where]
    before = sorted(p.relative_to(tmp_path) for p in data.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", episode, "-o", out,
                           "--format", "plain"], cwd=tmp_path, env=cli_env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    said = {"the_folder_of_episodes": "is also given as EPISODE",
            "the_folder_of_the_episode": "holds the EPISODE data/a",
            "inside_an_episode_of_the_folder_given": "is inside the episode folder data/a: the run's files would be "
                                                     "moved or deleted with the robot's",
            "inside_the_episode_given": "is inside the episode folder data/a: the run's files would be moved or "
                                        "deleted with the robot's"}
    said = said.get(where, "is an episode folder (it holds END, episode.yaml")
    assert f"Error: --out {out} {said}" in proc.stderr, proc.stderr
    assert "hint: choose another --out" in proc.stderr
    assert "planned" not in proc.stderr  # refused before the model loads
    assert sorted(p.relative_to(tmp_path) for p in data.rglob("*")) == before


@pytest.mark.parametrize("episode", [".", ".."])
def test_the_default_out_inside_a_followed_episode_folder_is_refused_as_an_explicit_one_is(tmp_path, cli_env, episode):
    """`cd data/a; ardiff rollout CFG . --follow` (or `..`, its folder of episodes) wrote the run into
    data/a/ardiff-runs, among the robot's step files, where `-o out` from there is refused (a recorder that renames or
    removes the episode folder takes the run with it): the default ./ardiff-runs follows the same rule."""
    data = tmp_path / "data"
    frame = np.zeros((16, 16, 3), np.uint8)
    write_episode(data / "a", [{"exterior_image_0": frame, "exterior_image_1": frame, "wrist_image": frame,
                                "joint_position": np.zeros(7, np.float32),
                                "gripper_position": np.zeros(1, np.float32)}], prompt="p")
    before = sorted(p.relative_to(tmp_path) for p in data.rglob("*"))
    named = "." if episode == "." else "../a"
    for out in ([], ["-o", "out"]):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", episode, *out,
                               "--follow", "--idle-timeout", "1", "--format", "plain"], cwd=data / "a", env=cli_env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        subject = "--out out" if out else f"the default output folder {data / 'a' / 'ardiff-runs'} (no --out given)"
        assert f"Error: {subject} is inside the episode folder {named}: the run's files would be moved or deleted " \
               "with the robot's" in proc.stderr, proc.stderr
        assert "planned" not in proc.stderr  # refused before the model loads
    assert proc.stderr.endswith("hint: choose another --out for the outputs, such as runs/eval1\n"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", episode, "--follow",
                           "--idle-timeout", "1", "--format", "plain"], cwd=data / "a", env=cli_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stderr.endswith("hint: pass --out DIR outside the episode folder, such as --out ../runs/eval1, or run "
                                "ardiff from elsewhere\n"), proc.stderr
    assert sorted(p.relative_to(tmp_path) for p in data.rglob("*")) == before


@pytest.mark.parametrize("option, value, why", [
    ("--memory-budget", "0", "a byte size must be positive, got '0'"),
    ("--memory-budget", "1.5", "a byte size without a unit is a whole number of bytes, got '1.5'"),
    # only --available takes auto; it said "no number before 'auto'", as if a number were missing
    ("--memory-budget", "auto", "'auto' is not a byte size: leave the option out for its default (only "
                                "inspect-capacity's --available takes auto)"),
    ("--memory-budget", "AUTO", "'auto' is not a byte size: leave the option out for its default"),
    # spaces around it, as around a number (it was taken as auto): --available ' auto' was "only --available takes auto"
    ("--available", " auto", "cannot read ' auto' as a byte size: a space or line break around or in it"),
    ("--gpu-memory-fraction", "nan", "expected a number in (0, 1], got 'nan'"),
    ("--gpu-memory-fraction", "0", "expected a number in (0, 1], got '0'"),
    ("--gpu-memory-fraction", "1.0000001", "expected a number in (0, 1], got '1.0000001'"),  # it read 'got 1'
])
def test_an_option_value_refused_early_names_the_option_and_says_why(option, value, why):
    """A usage error naming the option the user typed (not "command line: field 'runtime.gpu_memory_fraction'")."""
    result = runner.invoke(app, ["inspect-capacity", option, value])
    assert result.exit_code == 2
    unboxed = " ".join(re.sub("[│╭╮╰╯─]", " ", result.stderr).split())
    assert f"Invalid value for '{option}': {why}" in unboxed and "None" not in unboxed, unboxed
    assert "runtime." not in unboxed


@pytest.mark.parametrize(("args", "message", "ending"), [
    (["inspect-capacity", "--memory-budget", "0"],
     "Invalid value for '--memory-budget': a byte size must be positive, got '0'", "such as 512MiB or 2GiB)"),
    # Typer's own checks (min=, int) said what they expected in pydantic's words ("Input should be greater than or
    # equal to 1"); ardiff reads the number itself now
    (["rollout", "--session-capacity", "0"], "Invalid value for '--session-capacity': expected a whole number of "
     "sessions, 1 or more", ", got '0'"),
    (["warmup", "--session-capacity", "1.5"], "Invalid value for '--session-capacity': expected a whole number of "
     "sessions, 1 or more", ", got '1.5'"),
    (["inspect-capacity", "--sessions", "2", "--sessions", "0"], "Invalid value for '--sessions': expected a whole "
     "number of sessions, 1 or more", ", got '0'"),
    # 10**400 sessions overflowed the plan's float figures: a traceback, as "a bug in ardiff"
    (["inspect-capacity", "--available", "1MiB", "--sessions", str(10**400)], "Invalid value for '--sessions': "
     "expected at most 2147483647 sessions (no pool holds more), got '1000000000000000000000000000", "000000'"),
    (["rollout", "--session-capacity", str(2**31)], "Invalid value for '--session-capacity': expected at most "
     "2147483647 sessions (no pool holds more), got '2147483648'", "2147483648'"),
    (["rollout", "--order", "sideways"], "Invalid value for '--order': 'sideways' is not one of", "'sequential'."),
    (["rollout", "--swap-space", "auto"], "Invalid value for '--swap-space': 'auto' is not a byte size: leave the "
     "option out for its default", "takes auto)"),
    (["warmup", "--bogus"], "No such option: --bogus", ""),
])
def test_usage_errors_are_a_json_object_too_with_format_json(cli_env, args, message, ending):
    for fmt in (["--format", "json"], ["--format=JSON"]):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, *fmt], capture_output=True, text=True,
                              env=cli_env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        error = json.loads(proc.stdout)  # the whole of stdout: one object
        assert error["message"].startswith(message) and error["message"].endswith(ending), error
        assert error == {"kind": "usage_error", "message": error["message"], "hint": f"see ardiff {args[0]} --help",
                         "exit_code": 2}
        assert proc.stderr.endswith(f"Error: {error['message']}\nhint: see ardiff {args[0]} --help\n"), proc.stderr


@pytest.mark.parametrize(("args", "message", "command"), [
    (["rollout", "--folow"], "No such option: --folow (Possible options: --follow)", "ardiff rollout"),
    (["inspect-capacity", "--available"], "Option '--available' requires an argument.", "ardiff inspect-capacity"),
    (["warmup", "--format", "plain", "--dtype", "f64"], "Invalid value for '--dtype'", "ardiff warmup"),
    # without Typer's "Value error, "
    (["rollout", "--format", "jsn"], "Invalid value for '--format': 'jsn' is not one of 'auto', 'rich', 'plain', "
                                     "'json' (did you mean 'json'?)", "ardiff rollout"),
    (["bogus"], "No such command 'bogus'.", "ardiff"),
])
def test_usage_errors_read_error_then_hint_like_every_other_error(cli_env, args, message, command):
    """Not Typer's box: the `Error:` / `hint:` lines the README documents, for a script's grep as for a person."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args], capture_output=True, text=True, env=cli_env,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    first, hint = proc.stderr.splitlines()
    assert first.startswith(f"Error: {message}"), proc.stderr
    assert hint == f"hint: see {command} --help"


@pytest.mark.parametrize(("option", "offered"), [
    ("--gpu", ""), ("--model", ""), ("--mode", ""),  # were offered --out; --help, --order; --dtype, --order
    ("--folow", " (Possible options: --follow)"), ("--resumee", " (Possible options: --resume)"),
    ("--out-dir", " (Possible options: --out)"), ("--preveiw", " (Possible options: --preview)"),
    # what Click offered, then dropped: difflib's 0.6 asked again of the names without their '--' (`swap` and
    # 'swap-space': 0.57), and an option that begins the name typed was no likeness (`--output` for --out)
    ("--swap", " (Possible options: --swap-space)"), ("--output", " (Possible options: --out)"),
    ("--outdir", " (Possible options: --out)"), ("--ord", " (Possible options: --order)"),
    # what difflib's ratio left out: the one option a name of 4 letters or more begins, and one alike but for case
    # (alone: `--WARMUP` is not also --no-warmup); 3 letters are too few (`--gpu` is no --gpu-memory-fraction)
    ("--idle", " (Possible options: --idle-timeout)"), ("--sess", " (Possible options: --session-capacity)"),
    ("--FOLLOW", " (Possible options: --follow)"), ("--WARMUP", " (Possible options: --warmup)"),
    ("--Idle", " (Possible options: --idle-timeout)"), ("--mem", ""),
])
def test_an_unknown_option_is_offered_only_options_alike(cli_env, option, offered):
    """Click's difflib counted the '--' every option begins with: `--gpu` was offered --out, `--model` --help and
    --order, names that share nothing with it but a letter."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", option], capture_output=True, text=True,
                          env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"Error: No such option: {option}{offered}\nhint: see ardiff rollout --help\n", proc.stderr


@pytest.mark.parametrize(("command", "option", "offered"), [
    ("inspect-capacity", "--sess", " (Possible options: --session-capacity, --sessions)"),
    ("inspect-capacity", "--session", " (Possible options: --session-capacity, --sessions)"),
    ("inspect-capacity", "--sessi", " (Possible options: --session-capacity, --sessions)"),
    ("warmup", "--sess", " (Possible options: --session-capacity)"),
])
def test_an_unknown_option_that_begins_several_is_offered_each(cli_env, command, option, offered):
    """`inspect-capacity --sess 3` was offered --sessions alone (difflib's pick): a name of 4 letters or more that
    begins two options (--sessions, --session-capacity) was offered neither as a beginning; Click sorts the names."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, option, "3", "dreamzero-tiny"],
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"Error: No such option: {option}{offered}\nhint: see ardiff {command} --help\n", proc.stderr


UNRELATED = [("depth", "model"), ("threads", "model"), ("arm_steps", "model"), ("heads", "runtime"), ("node", "top"),
             ("medal", "top"), ("gpu", "device"), ("run.yaml", "files"), ("dropout", "fields"),
             # the beginning or a word of several longer names: any one offered is a guess (`dream` was offered
             # 'dreamzero-14b', a 14B model; `num` 'num_heads'), and `batch` one edit from a word of one ('patch_size')
             ("dream", "builtins"), ("tiny", "builtins"), ("world", "builtins"), ("num", "model"),
             ("token", "model"), ("batch", "model"),
             # a guess of several, which difflib's best ratio picked: `frames` 'sink_frames' (window_frames,
             # frames_per_block, frames_per_request), `image` 'image_dim', `text` 'text_len', `stride` 'vae_stride',
             # `patches` 'patch_size' (image_patch), `action` 'action_dim', `dreamzero` and `dreamzero-small` (no such
             # config) 'dreamzero-14b', a 14B model; `position` 'joint_position', `exterior` and `exterior_image`
             # 'exterior_image_1', `sweep` 'sweep2'
             ("frames", "model"), ("frame", "model"), ("image", "model"), ("text", "model"), ("stride", "model"),
             ("patches", "model"), ("action", "model"), ("dreamzero", "builtins"), ("dreamzero-small", "builtins"),
             ("position", "observation"), ("exterior", "observation"), ("exterior_image", "observation"),
             ("sweep", "runs"),
             # the other of a pair, or another number: `prompt` was 'negative_prompt', the one the prompt meant is
             # against (the prompt is an observation's, not the config's); `wrist_image_right` 'wrist_image_left',
             # `float64` 'float16', `float8` 'float32', `exterior_image_2` 'exterior_image_1', `sweep3` 'sweep2'
             ("prompt", "model"), ("Prompt", "model"), ("prompts", "model"), ("positive_prompt", "model"),
             ("wrist_image_right", "observation"), ("exterior_image_0_right", "observation"),
             ("exterior_image_2", "observation"), ("float64", "dtype"), ("float8", "dtype"), ("sweep3", "runs"),
             # a typo of two names alike: `f16` is fp16 or bf16
             ("f16", "dtype"),
             # of two sizes alike, the other number left out first made the tiny model the one offered for 1.3b
             ("dreamzero-1.3b", "builtins"), ("dreamzero-7b", "builtins"),
             # digits swapped name another of a count: `sweep21` was 'sweep12' (sweep13 beside it), `run_100` 'run_010'
             ("sweep21", "sweeps"), ("sweep31", "sweeps"), ("run_100", "sweeps"),
             # the count's last run past a power of ten: `sweep01` was 'sweep10' (sweep9 beside it was looked for as
             # 'sweep09')
             ("sweep01", "tens"),
             # a word with a first letter no finger slips to is another word: `batch_size` was 'patch_size'
             ("batch_size", "model"), ("batch_size", "causal"), ("batchsize", "causal"), ("image_batch", "model")]
TYPOS = [("modle", "top", "model"), ("runtim", "top", "runtime"), ("checkpoints", "top", "checkpoint"),
         ("layers", "model", "num_layers"), ("heads", "model", "num_heads"), ("threads", "runtime", "num_threads"),
         ("windw_frames", "model", "window_frames"), ("tny", "presets", "tiny"),
         ("dmi", "model", "dim"), ("cuda:0", "device", "cuda"), ("my_confg.yaml", "files", "my_config.yaml"),
         ("ROBOT.YAML", "files", "Robot.YAML"), ("DREAMZERO", "pipelines", "dreamzero"),
         ("causal-world", "pipelines", "causal_world"), ("dreamzero-tny", "builtins", "dreamzero-tiny"),
         ("evall", "runs", "eval1"), ("jont_position", "fields", "joint_position"), ("promt", "fields", "prompt"),
         ("output", "options", "out"), ("ord", "options", "order"),
         # alike, a beginning or a word of a longer name, but under difflib's ratio: they were offered nothing
         ("seq", "orders", "sequential"), ("steps", "model", "num_inference_steps"), ("sink", "model", "sink_frames"),
         ("sessions", "runtime", "session_capacity"), ("backend", "runtime", "attention_backend"),
         ("fraction", "runtime", "gpu_memory_fraction"), ("gpu_fraction", "runtime", "gpu_memory_fraction"),
         # case, '-' for '_', a plural, a prefix, a swap: the one name alike
         ("NUM_LAYERS", "model", "num_layers"), ("num-layers", "model", "num_layers"), ("Device", "runtime", "device"),
         ("devices", "runtime", "device"), ("guidance", "model", "guidance_scale"), ("cond", "causal", "cond_dim"),
         ("denoising", "causal", "denoising_timesteps"), ("TINY", "presets", "tiny"), ("14B", "presets", "14b"),
         ("lingbot", "builtins", "lingbot-world-14b"), ("dreamzero-14", "builtins", "dreamzero-14b"),
         ("Eval1", "runs", "eval1"), ("bfloat61", "dtype", "bfloat16"), ("bfloat", "dtype", "bfloat16"),
         ("--no-warm-up", "flags", "--no-warmup"), ("--warm-up", "flags", "--warmup"),
         # a side written short or misspelt is that side
         ("neg_prompt", "model", "negative_prompt"), ("negativ_prompt", "model", "negative_prompt"),
         # a word of one name, not a typo of another: `reset` was 'preset'
         ("reset", "model", "reset_at_window"),
         # a field's aliases are one field: `joint` (joint_position, observation/joint_position) was offered none
         ("joint", "observation", "joint_position"), ("grip", "observation", "gripper_position"),
         ("wrist", "observation", "wrist_image"), ("joint_positions", "observation", "joint_position"),
         ("observation/joint", "observation", "observation/joint_position"),
         ("language", "prompts", "language_instruction"), ("Prompt", "prompts", "prompt"),
         # the one name beginning so, of names holding it: `window` was offered nothing (reset_at_window holds it)
         ("window", "model", "window_frames"), ("patch", "model", "patch_size"),
         ("memory", "runtime", "memory_budget"),
         # a number of a count typed right, or a slip to the key beside a first letter: still a typo
         ("swep12", "sweeps", "sweep12"), ("sweep_13", "sweeps", "sweep13"), ("rum_010", "sweeps", "run_010"),
         ("bae_stride", "model", "vae_stride"), ("llm", "backends", "vllm")]


def _names(kind):
    import dataclasses

    import pipelines.causal_world as causal_world
    import pipelines.dreamzero as dreamzero
    from ardiff_cli.runtime.config import TOP_LEVEL_KEYS, RuntimeConfig, builtin_configs

    return {"model": ["preset", *(f.name for f in dataclasses.fields(dreamzero.Config) if f.init)],
            "causal": ["preset", *(f.name for f in dataclasses.fields(causal_world.Config) if f.init)],
            "top": list(TOP_LEVEL_KEYS), "runtime": list(RuntimeConfig.__dataclass_fields__),
            "device": ["auto", "cpu", "cuda"], "dtype": ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
            "files": ["t.yaml", "my_config.yaml", "Robot.YAML"], "presets": ["tiny", "small", "14b"],
            "fields": ["exterior_image_0", "wrist_image", "joint_position", "gripper_position", "prompt"],
            "observation": [k for f in dreamzero.observation_schema().fields for k in f.keys],
            "prompts": ["prompt", "language_instruction"],
            "pipelines": ["dreamzero", "causal_world"], "builtins": sorted(builtin_configs()),
            "runs": ["eval1", "eval-large", "sweep1", "sweep2"], "options": ["out", "order", "format", "follow"],
            "flags": ["--warmup", "--no-warmup"], "orders": ["round-robin", "sequential"],
            "sweeps": ["sweep12", "sweep13", "sweep14", "run_009", "run_010"],
            "backends": ["auto", "torch", "vllm"], "tens": ["sweep8", "sweep9", "sweep10"]}[kind]


def _close_match(name, kind):
    """``close_match`` as its callers ask: an observation's keys, and the prompt's, each standing for its field."""
    from pipelines.dreamzero import observation_schema

    from ardiff_cli.runtime.errors import close_match

    stands_for = {"observation": {k: f.name for f in observation_schema().fields for k in f.keys},
                  "prompts": dict.fromkeys(_names("prompts"), "prompt")}.get(kind)
    return close_match(name, _names(kind), stands_for=stands_for)


@pytest.mark.parametrize(("name", "kind"), UNRELATED)
def test_a_did_you_mean_never_names_what_shares_only_letters(name, kind):
    """difflib's ratio alone offered `depth` 'width', `steps` 'eps' (num_inference_steps was meant), `threads`
    'num_heads' under model: and `heads` 'num_threads' under runtime:, `gpu` 'cpu', and for a config file `run.yaml`
    not found, the 't.yaml' beside it: names with a few letters (or '.yaml') in common, and nothing else; and a
    name alike that misleads: one of several, the other of a pair, another number. A wrong name is worse than none,
    which leaves the user the list of valid names."""
    assert _close_match(name, kind) is None


@pytest.mark.parametrize(("name", "kind", "meant"), TYPOS)
def test_a_did_you_mean_still_names_a_typo_or_a_name_sharing_a_word(name, kind, meant):
    assert _close_match(name, kind) == meant


@pytest.mark.parametrize(("text", "unknown", "offered"), [
    ("model: {steps: 4}\n", "model.steps", " (did you mean 'num_inference_steps'?)"),
    ("runtime: {sessions: 4}\n", "runtime.sessions", ""),  # was 'session_capacity': a letter off its first word only
    ("model: {depth: 4}\n", "model.depth", ""),
    ("runtime: {heads: 4}\n", "runtime.heads", ""), ("model: {layers: 4}\n", "model.layers", " (did you mean "
                                                                                              "'num_layers'?)"),
    # the prompt is an observation's: 'negative_prompt', the one it is against, was offered
    ("model: {prompt: pick up the cube}\n", "model.prompt", ""),
    ("model: {neg_prompt: blurry}\n", "model.neg_prompt", " (did you mean 'negative_prompt'?)"),
    ("model: {frames: 4}\n", "model.frames", ""),  # was 'sink_frames', of four names holding it
    ("model: {reset: true}\n", "model.reset", " (did you mean 'reset_at_window'?)"),  # was 'preset'
    ("model: {window: 8}\n", "model.window", " (did you mean 'window_frames'?)"),  # reset_at_window holds it too
])
def test_an_unknown_config_key_is_offered_only_a_name_alike(tmp_path, text, unknown, offered):
    assert_inspect_capacity_refuses(tmp_path, f"pipeline: dreamzero\n{text}", f"unknown key '{unknown}'{offered}")


@pytest.mark.parametrize(("text", "unknown"), [
    ("pipeline: causal_world\nmodel: {reset: true}\n", "model.reset"),  # was 'preset', a name: `reset` is a word
    ("pipeline: dreamzero\nruntime: {gpu: 0.5}\n", "runtime.gpu"),  # was 'gpu_memory_fraction': a GPU may be the device
])
def test_a_key_in_a_section_is_offered_no_key_that_takes_no_such_value_or_words(tmp_path, text, unknown):
    """As at the top level: a key one letter off another is offered it only where that key takes its value, and a
    key holding a word of another only where that word is its last or all but one of its words."""
    assert_inspect_capacity_refuses(tmp_path, text, f"unknown key '{unknown}'")


def test_a_built_in_config_of_another_size_is_offered_none(tmp_path, cli_env):
    """`dreamzero-1.3b` was offered 'dreamzero-tiny', a CPU model: 'dreamzero-14b', the other name alike, was
    left out for its number first, which left one. A size asked for gets no other size."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "dreamzero-1.3b", "--available",
                           "8GiB", "--format", "plain"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=cli_env)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "Error: unknown config 'dreamzero-1.3b': not a file and not a built-in config\nhint: "), proc.stderr


def test_a_key_of_a_step_file_is_offered_the_one_field_alike(tmp_path, cli_env):
    """`joint` was offered nothing, its two names alike being one field's (joint_position and its alias
    observation/joint_position); `position` was offered 'joint_position' of three fields ending so, and
    `wrist_image_right` 'wrist_image_left', the other camera."""
    renamed = {"joint": "joint_position", "grip": "gripper_position", "position": "joint_position",
               "wrist_image_right": "wrist_image"}
    for key, field in renamed.items():
        episode(tmp_path / "eps" / key, 1, step0={field: None, key: good(0, 0)[field]})
    proc = rollout_of_episodes(tmp_path, tmp_path / "eps", cli_env, timeout=300)
    offered = dict(re.findall(r"not in the schema: '(\w+)'( \(did you mean '\w+'\?\))?", proc.stderr))
    assert offered == {"joint": " (did you mean 'joint_position'?)", "grip": " (did you mean 'gripper_position'?)",
                       "position": "", "wrist_image_right": ""}, proc.stderr


@pytest.mark.parametrize(("text", "unknown", "setting", "hint"), [
    ("model: {NUM_THREADS: 4}\n", "model.NUM_THREADS", "num_threads", "move it under `runtime:` as num_threads"),
    ("model: {num_threads: 4}\n", "model.num_threads", "num_threads", "move it under `runtime:` as num_threads"),
    ("model: {Device: cpu}\n", "model.Device", "device", "move it under `runtime:` as device"),
    ("NUM_THREADS: 4\n", "NUM_THREADS", "num_threads", "valid top-level keys"),
])
def test_a_runtime_setting_in_the_wrong_place_or_case_is_named_as_the_runtime_key(tmp_path, text, unknown, setting,
                                                                                   hint):
    """`model: {NUM_THREADS: 4}` was offered 'num_heads', a model key sharing letters with it: the key meant is
    runtime.num_threads. The model's own key of that name, in any case, is still the pipeline's to name."""
    config = tmp_path / "c.yaml"
    config.write_text(f"pipeline: dreamzero\n{text}")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "plain"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"Error: {config}: unknown key '{unknown}' (did you mean 'runtime.{setting}'? "
                                  f"runtime settings go under `runtime:`)\nhint: {hint}"), proc.stderr
    assert_inspect_capacity_refuses(tmp_path, "pipeline: dreamzero\nmodel: {Session_Capacity: 2}\n",
                                    "unknown key 'model.Session_Capacity' (did you mean 'session_capacity'?)")


@pytest.mark.parametrize(("text", "unknown", "key", "hint"), [
    ("runtime: {num_heads: 2}\n", "runtime.num_heads", "num_heads", "move it under `model:` as num_heads"),
    ("runtime: {NUM_HEADS: 5}\n", "runtime.NUM_HEADS", "num_heads", "move it under `model:` as num_heads"),
    ("runtime: {preset: tiny}\n", "runtime.preset", "preset", "move it under `model:` as preset"),
    ("NUM_HEADS: 2\n", "NUM_HEADS", "num_heads", "valid top-level keys"),
    ("Preset: tiny\n", "Preset", "preset", "valid top-level keys"),
])
def test_a_model_key_in_the_wrong_place_or_case_is_named_as_the_model_key(tmp_path, text, unknown, key, hint):
    """`runtime: {num_heads: 2}` was offered 'num_threads', a runtime key sharing letters with it, and a model key in
    another case at the top level (`NUM_HEADS:`) was offered nothing: the key meant is model.num_heads."""
    config = tmp_path / "c.yaml"
    config.write_text(f"pipeline: dreamzero\n{text}")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "plain"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"Error: {config}: unknown key '{unknown}' (did you mean 'model.{key}'? the "
                                  f"pipeline's settings go under `model:`)\nhint: {hint}"), proc.stderr


@pytest.mark.parametrize("word", ["-dash", "--dash"])
def test_an_episode_folder_named_like_an_option_is_named_in_the_hint_with_how_to_pass_it(tmp_path, cli_env, word):
    """`rollout CFG -dash` said only "No such option: -d": the folder is there, and `--` or ./-dash names it. A
    mistyped option with no such file gets the usual hint."""
    (tmp_path / word).mkdir()
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", word, "-x"], cwd=tmp_path,
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (f"Error: No such option: {word[:2] if word == '-dash' else word}\nhint: {word} is a file or "
                           f"folder here, not an option: to name it, put it after -- (ardiff rollout ... -- {word}) or "
                           f"write ./{word}; see ardiff rollout --help\n")
    (tmp_path / word).rmdir()
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", word], cwd=tmp_path,
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.endswith("\nhint: see ardiff rollout --help\n"), proc.stderr


def _follow(folder: Path, clock: FakeClock) -> StepScheduler:
    return StepScheduler([EpisodeSource(name="live", path=folder)], follow=True, idle_timeout=10, poll_interval=1,
                         clock=clock, sleep=clock.sleep)


def _drain(scheduler: StepScheduler) -> list:
    items = []
    while (item := scheduler.next()) is not None:
        items.append(item.file.step if not isinstance(item, EpisodeEnded) else (item.reason, str(item.error or "")))
    return items


def test_follow_waits_for_a_missing_step_then_runs_in_order(tmp_path):
    folder = tmp_path / "live"
    write_step(folder, 0, good(0, 0), prompt="p")
    write_step(folder, 2, good(0, 2))  # step 1 is still being written
    clock = FakeClock([lambda: None, lambda: None, lambda: write_step(folder, 1, good(0, 1)), lambda: None,
                       lambda: (folder / "END").write_bytes(b"")])
    assert _drain(_follow(folder, clock)) == [0, 1, 2, ("end_marker", "")]


@pytest.mark.parametrize("ending", ["end_marker", "idle_timeout"])
@pytest.mark.parametrize(("last", "missing"), [(3, "1, 2"), (1733312345123, "1, 2, 3, 4, 5 and 1733312345117 more")])
def test_follow_fails_an_episode_whose_gap_is_never_filled(tmp_path, ending, last, missing):
    """Also a step named by a timestamp, whose gap of 10**12 steps was listed one by one until the memory ran out."""
    folder = tmp_path / "live"
    write_step(folder, 0, good(0, 0), prompt="p")
    write_step(folder, last, good(0, 3))
    clock = FakeClock([lambda: (folder / "END").write_bytes(b"")] if ending == "end_marker" else [])
    items = _drain(_follow(folder, clock))
    assert items[0] == 0 and len(items) == 2
    reason, message = items[1]
    assert reason == "error"
    assert f"{folder}: steps {missing} missing: the episode has steps 0..{last} with a gap" in message


@pytest.mark.parametrize("ending", ["end_marker", "idle_timeout"])
def test_follow_runs_a_step_file_linked_to_nothing_so_that_reading_it_names_the_link(tmp_path, ending):
    """A step file that is a link to a recording on a disk not mounted fails its episode naming the link, with
    --follow as without. --follow skipped it: the episode ended cleanly after step 0, and the file was reported as
    having "arrived after its END file was seen" (--resume skipped it again). It is waited for as an unready file,
    then taken at END or at the idle timeout."""
    folder = tmp_path / "live"
    dangling_link(folder)  # steps 0 and 1, step 1 a link to nothing; END written
    if ending == "idle_timeout":
        (folder / "END").unlink()
    clock, warned = FakeClock(), []
    scheduler = StepScheduler([EpisodeSource(name="live", path=folder)], follow=True, idle_timeout=10,
                              poll_interval=1, clock=clock, sleep=clock.sleep, warn=warned.append)
    assert _drain(scheduler) == [0, 1, (ending, "")]
    assert warned == [] and scheduler.late == {}
    with pytest.raises(ObservationError, match=re.escape(f"{step1(folder)}: cannot read the step file: it is a link "
                                                         "to ../../nas/arm/step_000001.safetensors, which does not")):
        load_step(step1(folder))


def test_a_python_request_with_nan_is_refused_by_the_pipeline_too():
    """The finiteness check is part of the shared validator, not only of the file reader."""
    from pipelines.dreamzero import observation_schema

    from ardiff_cli.runtime.observation import validate_observation

    arrays = {
        "exterior_image_0": np.zeros((16, 16, 3), np.uint8),
        "exterior_image_1": np.zeros((16, 16, 3), np.uint8),
        "wrist_image": np.zeros((16, 16, 3), np.uint8),
        "joint_position": nan_joints(),
        "gripper_position": np.zeros(1, np.float32),
        "prompt": "pick",
    }
    with pytest.raises(ObservationError, match=r"^request r1: 'joint_position' has 1 NaN and 0 Inf values \(first at "
                                               r"index \(3,\)\), expected finite numbers$") as info:
        validate_observation(observation_schema(), arrays, where="request r1")
    assert "sensor dropout" in info.value.hint


def test_a_python_request_value_that_is_no_array_names_its_key_and_why():
    """A value numpy cannot make one array of (a ragged list of joint readings) is the ObservationError naming the
    key and numpy's reason, like every other bad field: not a ValueError from inside numpy."""
    from pipelines.dreamzero import observation_schema

    from ardiff_cli.runtime.observation import validate_observation

    image = np.zeros((16, 16, 3), np.uint8)
    arrays = {"exterior_image_0": image, "exterior_image_1": image, "wrist_image": image,
              "joint_position": [[0.0] * 4, [0.0] * 3], "gripper_position": np.zeros(1, np.float32), "prompt": "pick"}
    with pytest.raises(ObservationError, match=r"^request r1: 'joint_position' is not an array \(list: \w"):
        validate_observation(observation_schema(), arrays, where="request r1")


def test_validating_something_other_than_a_mapping_is_an_observation_error_naming_the_fields():
    """validate_observation(schema, None, where=...) (a client's observation not yet decoded, or a list of them) was
    an AttributeError: 'NoneType' object has no attribute 'items'."""
    from pipelines.dreamzero import observation_schema

    from ardiff_cli.runtime.observation import validate_observation

    for arrays, got in ((None, "None (NoneType)"), ([{"prompt": "pick"}], "[{'prompt': 'pick'}] (list)")):
        with pytest.raises(ObservationError, match=rf"^request r1: an observation is a mapping \(dict\) of field name "
                                                   rf"-> array, got {re.escape(got)}$") as info:
            validate_observation(observation_schema(), arrays, where="request r1")
        assert info.value.hint.startswith("pass a dict of its fields: exterior_image_0, ")


@pytest.mark.parametrize(("case", "message"), [
    ("end_marker", "its END marker came before any step file"),
    ("idle_timeout", "no step file arrived within --idle-timeout 10 s"),
])
def test_follow_fails_an_episode_that_ends_before_any_step_arrived(tmp_path, case, message):
    """As without --follow, an episode with no step file fails instead of counting as completed."""
    folder = tmp_path / "live"
    folder.mkdir()
    if case == "end_marker":
        (folder / "END").write_bytes(b"")
    assert _drain(_follow(folder, FakeClock())) == [("error", f"{folder}: {message}")]


def modes_bind() -> list[str]:
    """A command prefix under which file modes bind: root reads and enters anything, so as root `setpriv` drops the
    two capabilities that bypass modes (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); another user needs nothing."""
    if not IS_ROOT:
        return []
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: file modes do not bind")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}"]


@pytest.fixture
def locked(tmp_path):
    """A folder of mode 000 (no one but a privileged user lists or enters it), its mode given back at the end."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0)
    yield folder
    folder.chmod(0o755)


def test_a_step_file_that_cannot_be_read_is_named_with_a_hint(tmp_path, cli_env):
    """The EACCES a robot's account gets, for real (as root, with the capabilities that bypass modes dropped)."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    unreadable_file(tmp_path / "ep")
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout",
                               str(tmp_path / "fast.yaml"), str(tmp_path / "ep"), "-o", str(tmp_path / "run"),
                               "--no-warmup", "--format", "plain"], env=cli_env, capture_output=True, text=True,
                              timeout=300)
    finally:
        step1(tmp_path / "ep").chmod(0o644)
    assert proc.returncode == 2, proc.stderr  # its only episode failed
    assert (f"Error: episode 'ep' failed: {step1(tmp_path / 'ep')}: cannot read the step file: Permission denied\n"
            "hint: check that the file exists and that the user running ardiff may read it (permissions)\n"
            ) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("what", ["config", "missing config", "checkpoint", "cache"])
def test_a_path_in_a_folder_this_user_cannot_enter_is_a_config_error_naming_it(tmp_path, cli_env, locked, what):
    # Path.is_file() raises PermissionError there: it was "unexpected PermissionError ... a bug in ardiff" (exit 1),
    # and for the cache folder "CausalWorldPipeline.from_config() failed ... please report it", blaming the pipeline.
    (locked.parent / "c.yaml").write_text(f"pipeline: causal_world\ncheckpoint: {locked / 'w.safetensors'}\n")
    args = {"config": ["inspect-capacity", str(locked / "c.yaml")],
            "missing config": ["inspect-capacity", str(locked / "nope")],
            "checkpoint": ["inspect-capacity", str(locked.parent / "c.yaml")],
            "cache": ["warmup", "causal-world-tiny"]}[what]
    env = {**cli_env, "ARDIFF_CACHE_DIR": str(locked / "cache")} if what == "cache" else cli_env
    proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", *args, "--format", "plain"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    named = {"config": f"CONFIG {locked / 'c.yaml'}", "missing config": f"CONFIG {locked / 'nope'}",
             "checkpoint": f"{locked / 'w.safetensors'}",
             "cache": f"the default checkpoint {locked / 'cache'}/"}[what]
    assert "Error: " in proc.stderr and f"cannot look at {named}" in proc.stderr, proc.stderr
    assert ": Permission denied\n" in proc.stderr, proc.stderr
    # The fix for EACCES is the folders' modes (x to enter), not "check the path", which reads as a typo in it.
    hint = ("set ARDIFF_CACHE_DIR to a folder this user can read and write" if what == "cache"
            else "check the permissions of the folders on its path (each needs x for this user)")
    assert f"\nhint: {hint}\n" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "report" not in proc.stderr


def test_a_demo_folder_this_user_cannot_enter_is_a_config_error_naming_it(tmp_path, cli_env):
    # A shared cache whose demo folder another account made with umask 077: `ardiff rollout` was "unexpected
    # PermissionError ... this is a bug in ardiff" (exit 1), where the default checkpoint beside it was named.
    demo = tmp_path / "cache" / "demo"
    demo.mkdir(parents=True)
    demo.chmod(0)
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", "causal-world-tiny",
                               "-o", str(tmp_path / "run"), "--format", "plain"],
                              env={**cli_env, "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}, capture_output=True,
                              text=True, timeout=300)
    finally:
        demo.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: cannot look at the demo episodes in {demo}: Permission denied\n"
                                "hint: set ARDIFF_CACHE_DIR to a folder this user can read and write\n"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def homeless() -> list[str]:
    """A command prefix that runs it as a user id with no passwd entry and no HOME (a container run with `--user
    1234`): in a user namespace, where this user's own files are that id's."""
    import pwd
    import shutil

    uid = 4242
    while True:
        try:
            pwd.getpwuid(uid)
            uid += 1
        except KeyError:
            break
    prefix = [shutil.which("unshare") or "unshare", "--user", f"--map-user={uid}", f"--map-group={uid}"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=60)
    except OSError:
        probe = None
    if probe is None or probe.returncode != 0:
        pytest.skip("no unshare --user here (util-linux, user namespaces)")
    return [*prefix, "env", "-u", "HOME"]


@pytest.mark.parametrize("what", ["rollout", "warmup", "cache ~", "checkpoint ~", "out ~"])
def test_no_home_folder_to_find_is_a_config_error_naming_what_needs_it(tmp_path, cli_env, what):
    # HOME unset for a user id with no passwd entry: `rollout` (the demo's cache) was "unexpected RuntimeError: Could
    # not determine home directory ... a bug in ardiff" (exit 1), `warmup` blamed the pipeline's from_config(), and
    # `-o ~/run` made a folder named ~ in the working folder.
    (tmp_path / "c.yaml").write_text("pipeline: causal_world\ncheckpoint: ~/w.safetensors\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = {"rollout": ["rollout", "causal-world-tiny", "-o", str(tmp_path / "run")],
            "warmup": ["warmup", "causal-world-tiny"], "cache ~": ["warmup", "causal-world-tiny"],
            "checkpoint ~": ["inspect-capacity", str(tmp_path / "c.yaml")],
            "out ~": ["rollout", "causal-world-tiny", "-o", "~/run"]}[what]
    env = {k: v for k, v in cli_env.items() if k != "ARDIFF_CACHE_DIR" or what == "out ~"}
    if what == "cache ~":
        env["ARDIFF_CACHE_DIR"] = "~/cache"
    proc = subprocess.run([*homeless(), sys.executable, "-m", "ardiff_cli", *args, "--format", "plain"], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    named = {"rollout": "ardiff's cache folder (~/.cache/ardiff, as ARDIFF_CACHE_DIR is not set)",
             "cache ~": "ARDIFF_CACHE_DIR ~/cache", "checkpoint ~": "field 'checkpoint': ~/w.safetensors",
             "out ~": "Invalid value for '--out' / '-o': ~/run"}
    assert f"{named.get(what, named['rollout'])}: cannot tell which folder ~ is: HOME is not set" in proc.stderr, (
        proc.stderr)
    hint = {"checkpoint ~": "set HOME to this user's home folder, or write the checkpoint's full path",
            "out ~": "see ardiff rollout --help"}.get(what, "set ARDIFF_CACHE_DIR to a writable folder")
    assert f"\nhint: {hint}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "report" not in proc.stderr
    assert not list(cwd.iterdir()) and not (tmp_path / "run").exists()


def test_a_checkpoint_that_cannot_be_read_says_permission_denied(tmp_path, cli_env):
    """safetensors reports EACCES as a file not found: "No such file or directory" for a file that exists, with the
    hint to check that it is a .safetensors file."""
    checkpoint = tmp_path / "weights.safetensors"
    checkpoint.write_bytes(b"\x00" * 64)
    (tmp_path / "c.yaml").write_text(f"pipeline: causal_world\ncheckpoint: {checkpoint}\n")
    checkpoint.chmod(0)
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "warmup", str(tmp_path / "c.yaml"),
                               "--format", "plain"], env=cli_env, capture_output=True, text=True, timeout=300)
    finally:
        checkpoint.chmod(0o644)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot read checkpoint {checkpoint}: Permission denied\nhint: check the file's permissions" in proc.stderr


def test_a_folder_that_cannot_be_entered_is_named_not_a_traceback(tmp_path, cli_env, locked):
    # Path.exists raised PermissionError on `locked/run.json`: an unreadable episode folder among a folder of
    # episodes, `-o locked/run` and `--resume -o locked/run` each ended in a traceback ('this is a bug', exit 1).
    episode(tmp_path / "healthy", 1)

    def ardiff(*args: str) -> subprocess.CompletedProcess:
        return _rollout(tmp_path, cli_env, *args)

    proc = ardiff(str(tmp_path), "-o", str(tmp_path / "run"))  # tmp_path holds healthy/ and locked/
    assert proc.returncode == 4, proc.stderr
    assert (f"Error: episode 'locked' failed: {locked}: cannot list the episode folder: Permission denied\n"
            "hint: check that the folder exists and that the user running ardiff may read and enter it "
            "(permissions r-x)\n") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = ardiff(str(tmp_path / "healthy"), "-o", str(locked / "run"))
    assert proc.returncode == 2, proc.stderr
    assert f"Error: --out {locked / 'run'}: cannot create the output folder: Permission denied\n" in proc.stderr
    assert "Traceback" not in proc.stderr and "planned" not in proc.stderr  # refused before the model loads
    proc = ardiff("--resume", "-o", str(locked / "run"))
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {locked / 'run' / 'run.json'}: cannot read run info: Permission denied\nhint: " in proc.stderr
    assert "Traceback" not in proc.stderr


def _rollout(tmp_path: Path, cli_env: dict, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    command = [sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"), *args]
    return subprocess.run([*modes_bind(), *command, "--no-warmup", "--format", "plain"], env=cli_env,
                          capture_output=True, text=True, timeout=300)


def test_resume_of_a_run_whose_episode_folder_was_locked_since_fails_that_episode_alone(tmp_path, cli_env):
    """--resume takes its EPISODE folders from run.json, unchecked by the command line: one this user may no longer
    enter was 'unexpected PermissionError ... a bug in ardiff' (exit 1, no episode ran). It is one episode whose
    error names it, while the others run."""
    locked = episode(tmp_path / "locked", 1)
    episode(tmp_path / "healthy", 1)
    proc = _rollout(tmp_path, cli_env, str(locked), str(tmp_path / "healthy"), "-o", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    for name in ("results.jsonl", "summary.json"):  # as a run killed before its first step was recorded leaves it
        (tmp_path / "run" / name).unlink()
    locked.chmod(0)
    try:
        proc = _rollout(tmp_path, cli_env, "--resume", "-o", str(tmp_path / "run"))
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 4, proc.stderr  # some episodes failed
    assert (f"Error: episode 'locked' failed: {locked}: cannot list the episode folder: Permission denied\n"
            "hint: check that the folder exists and that the user running ardiff may read and enter it "
            "(permissions r-x)\n") in proc.stderr, proc.stderr
    assert [json.loads(line)["episode"] for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()
            if json.loads(line)["status"] == "ok"] == ["healthy"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("locked", ["parent", "folder"])
def test_an_episode_on_a_path_this_user_cannot_enter_fails_alone_in_a_run_and_in_its_resume(tmp_path, cli_env,
                                                                                           locked):
    """EPISODE in a folder this user may not enter (mode 000), or one it may list but not enter (mode 444):
    Path.exists and Path.is_dir raised PermissionError, so the run, and its --resume, ended in 'unexpected
    PermissionError ... a bug in ardiff' (exit 1) before any episode ran. It is one episode whose error names it,
    while the others run; once the folder is opened, --resume runs it."""
    healthy = episode(tmp_path / "healthy", 1)
    fenced = episode(tmp_path / "fence" / "b", 1)
    said = (f"Error: episode 'b' failed: {fenced}: cannot list the episode folder: Permission denied\n"
            "hint: check that the folder exists and that the user running ardiff may read and enter it")
    target, mode = (tmp_path / "fence", 0) if locked == "parent" else (fenced, 0o444)
    target.chmod(mode)
    try:
        runs = [_rollout(tmp_path, cli_env, str(healthy), str(fenced), "-o", str(tmp_path / "run")),
                _rollout(tmp_path, cli_env, "--resume", "-o", str(tmp_path / "run"))]
    finally:
        target.chmod(0o755)
    for proc in runs:
        assert proc.returncode == 4, proc.stderr  # some episodes failed
        assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = _rollout(tmp_path, cli_env, "--resume", "-o", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [(r["episode"], r["status"]) for r in lines if r["status"] == "ok"] == [("healthy", "ok"), ("b", "ok")]


def _schedule_under_modes(script: str, unlock: Path) -> str:
    """stdout of ``script`` (after the imports a scheduler needs) run where file modes bind; ``unlock``'s mode is
    given back after, whatever the script made it."""
    preamble = ("import os\nfrom pathlib import Path\nfrom fake_clock import FakeClock\nfrom ardiff_cli.io import "
                "write_step\nfrom ardiff_cli.io.episode import EpisodeSource, discover_episodes\nfrom "
                "ardiff_cli.io.stream import StepScheduler\nfrom test_reliability_input import good\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-c", preamble + script], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        unlock.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(("locked", "mode"), [("folder", "000"), ("folder", "444"), ("parent", "000")])
def test_a_followed_episode_folder_locked_mid_run_fails_that_episode_naming_why(tmp_path, locked, mode):
    """An episode folder made unenterable while --follow watches it (its recorder's account changed: no access at
    all, read but not enter, or a folder above it locked): looking for its END file, at it, or at a new step file
    raised PermissionError out of the scheduler, a traceback that stopped the whole run. The episode ends with the
    error of its folder, as when a listing of it fails."""
    folder = tmp_path / "robots" / "live"
    write_step(folder, 0, good(0, 0), prompt="p")
    target = folder if locked == "folder" else folder.parent
    stdout = _schedule_under_modes(f"""
clock = FakeClock()
scheduler = StepScheduler([EpisodeSource(name="live", path=Path({str(folder)!r}))], follow=True, idle_timeout=10,
                          poll_interval=1, clock=clock, sleep=clock.sleep)
print(scheduler.next().file.step)
write_step({str(folder)!r}, 1, good(0, 1))  # listed, then looked at: refused in a folder it may read, not enter
os.chmod({str(target)!r}, {int(mode, 8)})
ended = scheduler.next()
print(ended.reason, ended.error, scheduler.next())
""", target)
    assert stdout == f"0\nerror {folder}: cannot list the episode folder: Permission denied None\n"


def test_a_watched_folder_of_episodes_made_unenterable_mid_run_ends_its_episodes_naming_why(tmp_path):
    """`--follow robots/`, and robots/ becomes readable but not enterable (mode 444) just as a robot starts arm_b
    there: looking at the new entry raised PermissionError out of the scheduler, a traceback that stopped the run.
    Its followed episode fails naming its folder, the entry it cannot look at is not taken for an episode, and the
    run ends."""
    data = tmp_path / "robots"
    write_step(data / "arm_a", 0, good(0, 0), prompt="p")
    stdout = _schedule_under_modes(f"""
data = Path({str(data)!r})
clock = FakeClock()
scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                          sleep=clock.sleep, watch=[data], on_new_episode=print)
print(scheduler.next().file.step)
write_step(data / "arm_b", 0, good(0, 0), prompt="p")
os.chmod(data, 0o444)
while (item := scheduler.next()) is not None:
    print(item.episode.name, item.reason, item.error)
""", data)
    assert stdout == f"0\narm_a error {data / 'arm_a'}: cannot list the episode folder: Permission denied\n"


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, cli_env):
    """`-o` an existing folder this user may enter but not write (mode 555): a usage error naming it, not a failure
    after the model loaded, and nothing is made in it."""
    episode(tmp_path / "healthy", 1)
    out = tmp_path / "read-only"
    out.mkdir()
    out.chmod(0o555)
    try:
        proc = _rollout(tmp_path, cli_env, str(tmp_path / "healthy"), "-o", str(out))
    finally:
        out.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: --out {out}: cannot write the output folder: Permission denied\n"
            "hint: choose a folder you can write\n") in proc.stderr, proc.stderr
    assert list(out.iterdir()) == []
    assert "Traceback" not in proc.stderr and "planned" not in proc.stderr  # refused before the model loads


@pytest.mark.parametrize("given", ["EPISODE", "--out"])
def test_an_episode_or_out_folder_this_user_cannot_read_is_a_usage_error_naming_it(tmp_path, cli_env, locked, given):
    """A folder given on the command line that exists but that this user may not read: exit 2 naming the option and
    the folder, before the model loads or any output folder is made."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    episode(tmp_path / "healthy", 1)
    episodes, out = (locked, tmp_path / "run") if given == "EPISODE" else (tmp_path / "healthy", locked)
    proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"),
                           str(episodes), "-o", str(out), "--no-warmup", "--format", "json"], env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    option = "'EPISODE'" if given == "EPISODE" else "'--out' / '-o'"
    assert json.loads(proc.stdout) == {  # the whole of stdout: one object
        "kind": "usage_error", "message": f"Invalid value for {option}: path {str(locked)!r} is not readable.",
        "hint": "see ardiff rollout --help", "exit_code": 2}
    assert not (tmp_path / "run").exists() and "Traceback" not in proc.stderr


@pytest.mark.parametrize("value, why", [
    ("inf", "expected a finite number of seconds, got 'inf' (to wait for days"),
    ("1e400", "expected a number of seconds, 0 or more, got '1e400': too large to represent (a float holds up to "
              "1.8e308); to wait for days")])
def test_an_infinite_idle_timeout_is_a_usage_error_before_anything_is_made(tmp_path, cli_env, value, why):
    # `--follow --idle-timeout inf` (wait forever) passed min=0, made --out, loaded the model, then failed to write
    # run.json (JSON has no infinity): 'unexpected ValueError ... this is a bug', exit 1, a folder left behind. 1e400
    # is finite as typed, but past what a float holds (it read it as inf).
    episode(tmp_path / "ep", 1)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", str(tmp_path / "ep"),
                           "-o", str(out), "--follow", "--idle-timeout", value, "--format", "json"], env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)  # the whole of stdout: one object
    assert error["kind"] == "usage_error" and error["exit_code"] == 2
    assert error["message"].startswith(f"Invalid value for '--idle-timeout': {why}"), error
    assert not out.exists() and "Traceback" not in proc.stderr


def test_a_negative_zero_idle_timeout_is_zero(tmp_path, cli_env):
    # `--idle-timeout -0` passed the parser's `< 0` as -0.0: the error of an empty episode said "no step file arrived
    # within --idle-timeout -0 s", and run.json recorded -0.0. It is 0.
    (tmp_path / "empty").mkdir()
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", str(tmp_path / "empty"),
                           "-o", str(out), "--follow", "--idle-timeout", "-0", "--no-warmup", "--format", "plain"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "no step file arrived within --idle-timeout 0 s" in proc.stderr, proc.stderr
    recorded = json.loads((out / "run.json").read_text())["idle_timeout"]
    assert recorded == 0 and math.copysign(1, recorded) == 1, recorded


@pytest.mark.parametrize(("args", "what"), [
    (["{ep}", "-o", ""], "'--out' / '-o'"), (["{ep}", "--out="], "'--out' / '-o'"),
    ([""], "'EPISODE'"), (["{ep}", ""], "'EPISODE'"),
])
def test_an_empty_out_or_episode_is_a_usage_error_not_the_current_folder(tmp_path, cli_env, args, what):
    # Path("") is the current folder: `-o "$OUT"` with OUT unset wrote run.json, results.jsonl and episodes/ among
    # the files of the folder the script ran in (exit 0), and `rollout CFG "$EPISODE"` ran that folder as an episode
    # after loading the model. CONFIG "" was refused already.
    episode(tmp_path / "ep", 1)
    here = tmp_path / "here"
    here.mkdir()
    args = [arg.format(ep=tmp_path / "ep") for arg in args]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", *args, "--format", "json"],
                          cwd=here, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)  # the whole of stdout: one object
    assert error["kind"] == "usage_error", error
    assert error["message"] == (f"Invalid value for {what}: an empty string is not a folder (a variable that is not "
                                "set?); write . for the current folder")
    assert list(here.iterdir()) == []  # nothing written where the command ran


def test_an_out_that_looks_like_an_option_is_a_usage_error_not_a_folder(tmp_path, cli_env):
    # `--out --preview` (the folder left out) made a folder named `--preview` and ran without previews, exit 0.
    # `./--preview` names such a folder, and the hint of a second run there gives it so.
    episode(tmp_path / "ep", 1)
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    here = tmp_path / "here"
    here.mkdir()

    def rollout(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"),
                               str(tmp_path / "ep"), *args, "--no-warmup", "--format", "json"], cwd=here,
                              env=cli_env, capture_output=True, text=True, timeout=300)

    for args in (["--out", "--preview"], ["-o", "-x"], ["--out=-q"]):
        proc = rollout(*args)
        assert proc.returncode == 2, proc.stderr
        error = json.loads(proc.stdout)  # the whole of stdout: one object
        value = args[-1].removeprefix("--out=")
        assert error["kind"] == "usage_error", error
        assert error["message"] == (f"Invalid value for '--out' / '-o': {value!r} looks like an option, not a folder "
                                    f"(was the folder left out?); if a folder of that name is meant, write ./{value}")
        assert list(here.iterdir()) == []
    assert rollout("--out", "./--preview").returncode == 0
    assert (here / "--preview" / "run.json").is_file()
    proc = rollout("--out", "./--preview")
    assert proc.returncode == 2 and json.loads(proc.stdout)["hint"].startswith(
        "continue it with: ardiff rollout --resume --out ./--preview;"), proc.stdout


def test_an_episode_yaml_that_is_not_yaml_or_not_readable_is_one_line_and_a_hint(tmp_path, cli_env):
    # It was PyYAML's own text, five lines quoting the file as "<unicode string>" with a caret drawn under it and no
    # hint (a config's YAML error is one line naming the line and column); one that could not be read repeated its
    # path ("[Errno 13] Permission denied: '.../episode.yaml'").
    eps = tmp_path / "eps"
    for name in ("unclosed", "locked", "healthy"):
        episode(eps / name, 1)
    (eps / "unclosed" / "episode.yaml").write_text("prompt: [pick up the cube\n")
    (eps / "locked" / "episode.yaml").chmod(0)
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "fast.yaml"),
                           str(eps), "--out", str(tmp_path / "run"), "--no-warmup", "--format", "plain"], env=cli_env,
                          capture_output=True, text=True, timeout=300)
    (eps / "locked" / "episode.yaml").chmod(0o644)
    assert proc.returncode == 4, proc.stderr
    assert (f"Error: episode 'unclosed' failed: {eps / 'unclosed' / 'episode.yaml'}: cannot read episode metadata: "
            "not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow "
            "sequence)\nhint: check the indentation, quotes and brackets there and on the line before; episode.yaml "
            "holds `key: value` lines") in proc.stderr, proc.stderr
    assert (f"Error: episode 'locked' failed: {eps / 'locked' / 'episode.yaml'}: cannot read episode metadata: "
            "Permission denied\nhint: check that the user running ardiff may read it") in proc.stderr, proc.stderr
    assert "<unicode string>" not in proc.stderr and "Errno" not in proc.stderr


def tiny_config_record() -> dict:
    """run.json's config_path and config_sha256, as a rollout of the tiny DreamZero config writes them."""
    import hashlib

    from ardiff_cli.runtime.config import resolve_config

    config = resolve_config("dreamzero-tiny").resolve()
    return {"config_path": str(config), "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()}


@pytest.mark.parametrize(("field", "edit", "expected", "got"), [
    ("config", lambda info: info.pop("config"), "a string", "nothing (the field is missing)"),
    ("dtype", lambda info: info.update(dtype=32), "float32, bfloat16 or float16", "32"),
    ("episodes", lambda info: info.update(episodes="arm_a"), 'a list of {"name": ..., "path": ...} objects',
     "'arm_a'"),
    ("episodes[0]", lambda info: info["episodes"][0].pop("path"),
     'an object with the episode\'s "name" and "path" (strings)', "{'name': 'arm_a'}"),
    # Those below were a traceback, or another message than run.json's: the command line's ("command line: field
    # 'runtime.dtype'"), another run's kept snapshots (a resume without `started` took a start time of its own), a
    # failed episode (its outputs refused outside OUT/episodes), an episode folder read against today's folder.
    ("config_path", lambda info: info.pop("config_path"), "the absolute path of the run's config file (a string)",
     "nothing (the field is missing)"),
    ("config_path", lambda info: info.update(config_path=3), "the absolute path of the run's config file (a string)",
     "3"),
    ("dtype", lambda info: info.update(dtype="float33"), "float32, bfloat16 or float16", "'float33'"),
    ("started", lambda info: info.pop("started"), "the run's start time in seconds since the epoch (a number)",
     "nothing (the field is missing)"),
    ("episodes[0].name", lambda info: info["episodes"][0].update(name="../evil"),
     "an episode name as ardiff records it, one folder name (no '/', no leading '.')", "'../evil'"),
    ("episodes[0].path", lambda info: info["episodes"][0].update(path="arm_a"),
     "the absolute path of the episode's folder", "'arm_a'"),
    ("episodes[1].name", lambda info: info["episodes"].append(dict(info["episodes"][0])),
     "a name no other episode of the run has (ardiff records each once), not that of episodes[0]", "'arm_a'"),
    # taken for true: the resume ran the demo episodes, and refused them as not the run's ("the episodes differ")
    ("demo", lambda info: info.update(demo="no"), "true or false", "'no'"),
])
def test_a_run_json_lacking_what_resume_reads_is_named_not_a_traceback(tmp_path, cli_env, field, edit, expected, got):
    # A run.json edited by hand (or cut by a copy) without `config` or `dtype`, or with `episodes` of another shape,
    # ended in 'unexpected KeyError' or 'TypeError ... this is a bug in ardiff' (exit 1); its other fields (watch,
    # the recorded options) were already named.
    info = {"format": 1, "config": "dreamzero-tiny", **tiny_config_record(), "dtype": "float32", "demo": False,
            "started": 1796379443.5, "episodes": [{"name": "arm_a", "path": str(episode(tmp_path / "arm_a", 1))}]}
    edit(info)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(info))
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", str(run), "--format",
                           "json"], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)  # the whole of stdout: one object
    assert error["kind"] == "config_error", error
    assert error["message"] == f"{run / 'run.json'}: field '{field}': expected {expected}, got {got}"
    assert error["hint"].startswith("correct it there") and "Traceback" not in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]  # refused before anything was written


def a_run_of(run: Path, folders: list[Path]) -> Path:
    """A run folder whose run.json (as a rollout of the tiny DreamZero config writes it) lists ``folders``."""
    run.mkdir()
    (run / "run.json").write_text(json.dumps({
        "format": 1, "config": "dreamzero-tiny", **tiny_config_record(), "dtype": "float32", "demo": False,
        "started": 1796379443.5, "episodes": [{"name": f.name, "path": str(f)} for f in folders]}))
    return run


FOLDER_HINT = "move that folder out of the way and restore the file from a backup"
READ_HINT = "check that it is a file the user running ardiff may read (permissions r--)"


@pytest.mark.parametrize(("damage", "message", "hint"), [
    ("results.jsonl folder", "{run}/results.jsonl: cannot read it: it is a folder, not a file", FOLDER_HINT),
    # "Too many levels of symbolic links", hint: permissions r--
    ("results.jsonl loop", "{run}/results.jsonl: cannot read it: it is a link to results.jsonl, which leads back to "
     "itself (a loop of links)", "replace that link with the file (restore it from a backup)"),
    ("results.jsonl mode 000", "{run}/results.jsonl: cannot read it: Permission denied", READ_HINT),
    # a FIFO in place of either file: opening it waited for a writer, forever (SIGTERM did not end the wait)
    ("results.jsonl fifo", "{run}/results.jsonl: cannot read it: it is a FIFO, socket or device, not a file",
     READ_HINT),
    # episodes.jsonl, the episodes a --follow run added or moved, as results.jsonl; a link to nothing (a disk not
    # mounted) was read as no lines: the episodes it held dropped from the run
    ("episodes.jsonl folder", "{run}/episodes.jsonl: cannot read it: it is a folder, not a file", FOLDER_HINT),
    ("episodes.jsonl loop", "{run}/episodes.jsonl: cannot read it: it is a link to episodes.jsonl, which leads back "
     "to itself (a loop of links)", "replace that link with the file (restore it from a backup)"),
    ("episodes.jsonl mode 000", "{run}/episodes.jsonl: cannot read it: Permission denied", READ_HINT),
    ("episodes.jsonl fifo", "{run}/episodes.jsonl: cannot read it: it is a FIFO, socket or device, not a file",
     READ_HINT),
    ("episodes.jsonl nothing", "{run}/episodes.jsonl: cannot read it: it is a link to ../disk/episodes.jsonl, which "
     "does not exist", "mount what it links to, or replace that link with the run's episodes.jsonl (a file) from a "
     "backup"),
    ("summary.json folder", "{run}/summary.json is a folder, not the run's summary file",
     "move that folder out of the way: the run writes summary.json there as it ends"),
    ("run.json folder", "{run}/run.json: cannot read run info: it is a folder, not a file",
     "move that folder out of the way and restore the run's run.json (a file) from a backup, or start a new run in "
     "another --out"),
    ("run.json loop", "{run}/run.json: cannot read run info: it is a link to run.json, which leads back to itself "
     "(a loop of links)", "replace that link with the run's run.json (a file) from a backup, or start a new run in "
     "another --out"),
    ("run.json mode 000", "{run}/run.json: cannot read run info: Permission denied",
     "check that the user running ardiff may read it (permissions r--)"),
    (".lock folder", "--out {run}: its .lock is a folder, not the file ardiff locks",
     "remove that folder ({run}/.lock): ardiff makes .lock itself, a file it holds locked to keep a second rollout "
     "off the run"),
    # it read "cannot write the output folder: Too many levels of symbolic links", hint: choose a folder you can write
    (".lock loop", "--out {run}: its .lock is a link to .lock, which leads back to itself (a loop of links)",
     "remove that link ({run}/.lock): ardiff makes .lock itself, a file it holds locked to keep a second rollout "
     "off the run"),
])
def test_a_run_file_that_is_a_folder_or_cannot_be_read_is_named_on_resume(tmp_path, cli_env, damage, message, hint):
    # A results.jsonl or summary.json that is a folder, or a results.jsonl this user may not read, ended in
    # 'unexpected IsADirectoryError ... this is a bug in ardiff' (exit 1); a results.jsonl linking to itself was taken
    # for none (every step ran again, then appending to it failed: exit 1). run.json said "[Errno 21] Is a directory:
    # 'OUT/run.json'" (or Errno 13), and that it "was cut or edited"; a .lock folder, "cannot write the output folder".
    run = a_run_of(tmp_path / "run", [episode(tmp_path / "arm_a", 1)])
    name, what = damage.split(" ", 1)
    (run / name).unlink(missing_ok=True)
    if what == "folder":
        (run / name).mkdir()
    elif what == "loop":
        (run / name).symlink_to(name)
    elif what == "fifo":
        os.mkfifo(run / name)
    elif what == "nothing":
        (run / name).symlink_to(Path("..", "disk", name))
    else:
        (run / name).write_text('{"format": 1}\n')
        (run / name).chmod(0)
    proc = subprocess.run([*(modes_bind() if "mode" in what else []), sys.executable, "-m", "ardiff_cli", "rollout",
                           "--resume", "-o", str(run), "--format", "json"], env=cli_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)  # the whole of stdout: one object
    assert (error["kind"], error["message"], error["hint"]) == ("config_error", message.format(run=run),
                                                                hint.format(run=run)), error
    assert "Traceback" not in proc.stderr and "planned" not in proc.stderr  # refused before the model loads


def test_resume_out_a_folder_of_run_folders_hints_which_to_give_not_a_new_run_among_them(tmp_path, cli_env):
    # `ardiff rollout --resume -o runs` (runs holding run folders, no run itself) hinted "run without --resume to
    # start a run in this folder": a new run among the old ones. It hints what the same folder given without -o,
    # as CONFIG or as EPISODE, is hinted: `--resume -o RUN`, or the resume of the one run it holds.
    (tmp_path / "runs").mkdir()
    for name in ("eval1", "eval2"):
        a_run_of(tmp_path / "runs" / name, [episode(tmp_path / f"arm_{name}", 1)])
    command = [sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", "runs", "--format"]
    proc = subprocess.run([*command, "plain"], env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"Error: nothing to resume: {Path('runs', 'run.json')} does not exist\nhint: runs is a "
                           "folder of ardiff run folders: give one of its runs as --out: ardiff rollout --resume -o "
                           "RUN\n")
    shutil.rmtree(tmp_path / "runs" / "eval2")
    proc = subprocess.run([*command, "json"], env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["hint"] == ("runs is a folder of ardiff run folders: give its one run as --out: "
                                               f"ardiff rollout --resume --out {Path('runs', 'eval1')}"), proc.stdout
    assert sorted(os.listdir(tmp_path / "runs")) == ["eval1"]  # refused before anything was written there


@pytest.mark.parametrize("given", [["--resume", "runs/eval1"], ["--resume", "-o", "runs/eval1", "arm_a"],
                                   ["--resume", "-o", "runs"], ["runs/eval1"], ["runs"],
                                   ["dreamzero-tiny", "runs/eval1"]])
def test_a_resume_given_no_warmup_refused_before_it_starts_hints_the_resume_with_it(tmp_path, cli_env, given):
    # A resume given --no-warmup refused before it starts (the run's folder as CONFIG, --out not given; an episode
    # folder as CONFIG; the folder of runs as --out) hinted the resume without it, which pasted ran the warmup still
    # ahead of the run: a stop there (_before_warmup) kept it. Its hint keeps it, and the options given; pasted, the
    # resume finishes the run with no warmup request. So does a new run whose CONFIG is the run's folder, or the
    # folder of runs holding it (`ardiff rollout runs/eval1 --no-warmup`, --resume and -o forgotten), or whose EPISODE
    # is: its hint, that run's resume, left the options given out.
    run = tmp_path / "runs" / "eval1"
    episode(tmp_path / "arm_a", 2)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", "arm_a", "-o", "runs/eval1",
                           "--no-warmup", "--format", "plain"], env=cli_env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    (run / "summary.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *given, "--memory-budget", "1GiB",
                           "--no-warmup", "--format", "json"], env=cli_env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    again = "ardiff rollout --resume --out runs/eval1 --memory-budget 1GiB --no-warmup"
    assert json.loads(proc.stdout)["hint"].endswith(f": {again}"), proc.stdout
    assert not (run / "summary.json").exists()  # refused before it started
    pasted = _pasted(again + " --format plain", tmp_path, cli_env)
    assert pasted.returncode == 0, pasted.stderr
    assert "__ardiff_warmup__" not in pasted.stderr and ok_steps(run) == {("arm_a", 0), ("arm_a", 1)}, pasted.stderr


def test_resume_out_a_folder_of_one_run_hints_its_resume_with_the_options_given(tmp_path, cli_env):
    # `ardiff rollout --resume -o runs --memory-budget 1GiB` (runs holding one run) hinted that run's resume without
    # the options given, where `--resume runs` (no --out) gave them: pasted, its run went on with another budget.
    (tmp_path / "runs").mkdir()
    a_run_of(tmp_path / "runs" / "eval1", [episode(tmp_path / "arm_a", 1)])
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", "runs", "--memory-budget",
                           "1GiB", "--session-capacity", "1", "--preview", "--format", "plain"], env=cli_env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert _hint(proc.stderr) == (f"runs is a folder of ardiff run folders: give its one run as --out: ardiff rollout "
                                  f"--resume --out {Path('runs', 'eval1')} --memory-budget 1GiB --preview "
                                  "--session-capacity 1"), proc.stderr


def test_resume_out_a_folder_holding_a_run_and_another_file_hints_the_runs_resume_not_a_new_run(tmp_path, cli_env):
    # `--resume -o runs`, runs holding a run and a notes.txt, hinted "run without --resume to start a run in this
    # folder": a new run there is refused (it would hold that run). One test of "holds a run folder" for both.
    (tmp_path / "runs").mkdir()
    a_run_of(tmp_path / "runs" / "eval1", [episode(tmp_path / "arm_a", 1)])
    (tmp_path / "runs" / "notes.txt").write_text("eval1: the baseline\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", "runs", "--memory-budget",
                           "1GiB", "--format", "plain"], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert _hint(proc.stderr) == (f"runs is a folder of ardiff run folders: give its one run as --out: ardiff rollout "
                                  f"--resume --out {Path('runs', 'eval1')} --memory-budget 1GiB"), proc.stderr


def test_a_new_run_out_a_folder_of_run_folders_is_refused_naming_them(tmp_path, cli_env):
    # `ardiff rollout CFG arm_a -o runs` (runs holding run folders, as ./ardiff-runs does) wrote its run.json and
    # results among them: `--resume -o runs` then resumed that run, not one of them, and each of them was a folder
    # inside a run's. It is refused, nothing written there, other files beside them or not; an empty folder, or one
    # holding no run folder, is not.
    (tmp_path / "runs").mkdir()
    episode(tmp_path / "arm_a", 1)
    a_run_of(tmp_path / "runs" / "eval1", [tmp_path / "arm_a"])
    command = [sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", "arm_a", "--no-warmup", "--format"]
    proc = subprocess.run([*command, "plain", "-o", "runs"], env=cli_env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("Error: --out runs holds an ardiff run folder (eval1): a new run written there would hold "
                           "it, and --resume -o runs would resume the new run, not that one\nhint: give a new "
                           f"folder inside it, such as --out {Path('runs', 'NAME')}; or continue its one run with: "
                           f"ardiff rollout --resume --out {Path('runs', 'eval1')}\n")
    a_run_of(tmp_path / "runs" / "eval2", [tmp_path / "arm_a"])
    (tmp_path / "runs" / "notes.txt").write_text("eval2: after the fix\n")  # no longer only run folders
    proc = subprocess.run([*command, "json", "-o", "runs"], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)
    assert (error["kind"], error["message"], error["hint"]) == (
        "config_error", "--out runs holds ardiff run folders (eval1, eval2): a new run written there would hold them, "
        "and --resume -o runs would resume the new run, not one of them", "give a new folder inside it, such as "
        f"--out {Path('runs', 'NAME')}; or continue one of its runs with: ardiff rollout --resume -o RUN"), error
    assert sorted(os.listdir(tmp_path / "runs")) == ["eval1", "eval2", "notes.txt"]
    # a new folder inside it, as the hint says; an empty folder (./ardiff-runs too), or one holding another file
    (tmp_path / "ardiff-runs").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x\n")
    for out in ("runs/eval3", "ardiff-runs", "notes"):
        proc = subprocess.run([*command, "plain", "-o", out], env=cli_env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert ok_steps(tmp_path / out) == {("arm_a", 0)}


def test_resume_given_an_episode_folder_first_says_it_is_a_folder(tmp_path, cli_env):
    # `ardiff rollout --resume -o RUN data/arm_a` read "config file not found: data/arm_a" of a folder that is
    # there (without --resume the same mistake says that CONFIG is a folder).
    folder = episode(tmp_path / "arm_a", 1)
    run = a_run_of(tmp_path / "run", [folder])
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", str(run), str(folder),
                           "--format", "plain"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"Error: CONFIG '{folder}' is a folder; the first argument is a config file or a built-in "
                           "config name\nhint: with --resume the config and episodes are the run's (run.json): leave "
                           f"them out, or give the config before them; to paste: ardiff rollout --resume --out {run}\n")


def test_a_run_folder_given_as_config_hints_its_resume(tmp_path, cli_env):
    # `ardiff rollout runs/eval1` (the run to finish, --resume and -o forgotten) was told to "pass the config first:
    # ardiff rollout dreamzero-tiny runs/eval1", a command refused in turn (a run folder is not an episode).
    (tmp_path / "runs").mkdir()
    run = a_run_of(tmp_path / "runs" / "eval1", [episode(tmp_path / "arm_a", 1)])
    for given, hint in ((run, "it is an ardiff run folder (what a rollout wrote); to finish its run: ardiff rollout "
                              f"--resume --out {run}"),
                        (run.parent, "it is a folder of ardiff run folders (what a rollout wrote); to finish its "
                                     f"one run: ardiff rollout --resume --out {run}")):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(given), "--format", "plain"],
                              env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"Error: CONFIG '{given}' is a folder; the first argument is a config file or a "
                               f"built-in config name\nhint: {hint}\n")
    # an episode folder given so is still told to put the config first
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(tmp_path / "arm_a"), "--format", "plain"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"\nhint: pass the config first: ardiff rollout dreamzero-tiny {tmp_path / 'arm_a'} "
                                "--format plain\n")


def test_a_complete_run_folder_given_as_config_or_episode_is_hinted_complete_and_what_its_resume_still_does(
        tmp_path, cli_env):
    # `ardiff rollout runs/eval1` of a run whose every step was done was told "to finish its run: ardiff rollout
    # --resume --out runs/eval1", which pasted said "4 steps already done" and exited 0: nothing was left to finish
    # but the steps its episodes got since, which that resume runs
    from test_cli_rollout import pasted

    root = Path(os.path.realpath(tmp_path))
    for name in ("arm_a", "arm_b"):
        episode(root / "eps" / name, 2)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", "eps", "-o", "runs/eval1",
                           "--no-warmup"], env=cli_env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    resume = "ardiff rollout --resume --out runs/eval1"
    complete = f"is complete (summary.json: status ok); a resume runs only steps added since: {resume}"
    for given, hint in ((["runs/eval1"], f"it is an ardiff run folder (what a rollout wrote); its run {complete}"),
                        (["runs/eval1", "--format", "json"],
                         f"it is an ardiff run folder (what a rollout wrote); its run {complete}"),
                        (["dreamzero-tiny", "runs/eval1"],
                         f"pass the folders of step files the robots wrote; its run {complete}"),
                        (["runs"],
                         f"it is a folder of ardiff run folders (what a rollout wrote); its one run {complete}")):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *given], env=cli_env, cwd=root,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert (json.loads(proc.stdout)["hint"] if "json" in given else _hint(proc.stderr)) == hint
    # pasted, that resume runs the one step arm_a got since, and no other
    write_step(root / "eps" / "arm_a", 2, good(0, 2))
    proc = pasted(cli_env, f"{resume} --no-warmup", root)
    assert proc.returncode == 0, proc.stderr
    done = [(r["episode"], r["step"]) for r in map(json.loads, (root / "runs/eval1/results.jsonl").read_text()
                                                   .splitlines()) if r["status"] == "ok"]
    assert sorted(done) == [("arm_a", 0), ("arm_a", 1), ("arm_a", 2), ("arm_b", 0), ("arm_b", 1)], done
    # a run stopped before its end (no summary.json, as a kill leaves it) is hinted its resume to finish it
    (root / "runs" / "eval1" / "summary.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "runs/eval1"], env=cli_env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert _hint(proc.stderr) == f"it is an ardiff run folder (what a rollout wrote); to finish its run: {resume}"


def test_a_folder_of_several_run_folders_given_to_resume_without_out_hints_resume_out_run(tmp_path, cli_env):
    # `ardiff rollout --resume runs` (two runs in it) hinted "the run printed it as 'outputs: DIR'", not the
    # `--resume -o RUN` that the same folder given as CONFIG or EPISODE is hinted
    (tmp_path / "runs").mkdir()
    for name in ("eval1", "eval2"):
        a_run_of(tmp_path / "runs" / name, [episode(tmp_path / f"arm_{name}", 1)])
    for given in (["--resume", "runs"], ["runs"], ["dreamzero-tiny", "runs"]):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *given, "--format", "plain"],
                              env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert _hint(proc.stderr).endswith(": ardiff rollout --resume -o RUN"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "runs", "--format", "plain"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert _hint(proc.stderr) == ("runs is a folder of ardiff run folders: give one of its runs as --out, not as "
                                  "CONFIG or EPISODE: ardiff rollout --resume -o RUN"), proc.stderr


# what a run folder's hint says of a .lock holding the pid 12345 alone, which no process holds (a stopped rollout's)
PID_ALONE = ("its .lock holds only the pid of the rollout that wrote it (12345: an older ardiff, or a resume, records "
             "no more), and no process holds its lock: that rollout has ended")


def test_a_run_folder_of_a_model_still_loading_given_as_config_has_nothing_to_resume(tmp_path, cli_env):
    # a rollout stopped while its model loaded leaves only .lock (run.json is written after): as CONFIG it was told
    # "to finish its run: ardiff rollout --resume -o RUN", which, pasted, says "nothing to resume: run.json does not
    # exist". Its .lock records the rollout that starts it again (see the test below); one an older ardiff wrote
    # records nothing, which the hint says, giving no command that cannot run as pasted (CONFIG EPISODE...).
    run = tmp_path / "runs" / "eval1"
    run.mkdir(parents=True)
    (run / ".lock").write_text("12345\n")  # the pid alone, as an older ardiff wrote it
    episode(tmp_path / "arm_a", 1)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "runs/eval1", "--format", "plain"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("Error: CONFIG 'runs/eval1' is a folder; the first argument is a config file or a built-in "
                           "config name\nhint: it is an ardiff run folder (what a rollout wrote); it has no run.json: "
                           "its model was loading when it stopped, so there is nothing to resume, and nothing in the "
                           f"folder records its config and episodes ({PID_ALONE}); to start its run again: ardiff "
                           "rollout with its config and episodes, and --out runs/eval1\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", "arm_a", "--out",
                           "runs/eval1", "--no-warmup", "--format", "plain"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and (run / "run.json").is_file(), proc.stderr


def _pasted(command: str, cwd: Path, env: dict, *, script: bool = False) -> subprocess.CompletedProcess:
    """``command``, as a hint printed it, run by bash in ``cwd`` as a user pasting it would (``ardiff``: this one;
    ``script``: as the installed ``ardiff`` script runs it, its working folder not on sys.path as ``-m`` puts it)."""
    python = '"$PASTE_PYTHON" -P' if script else '"$PASTE_PYTHON"'
    path = ardiff_program(*(["-P"] if script else []))  # the program `env -C FOLDER ... ardiff` runs
    return subprocess.run(["bash", "-c", f'ardiff() {{ {python} -m ardiff_cli "$@"; }}\n{command}'], cwd=cwd,
                          env={**env, "PASTE_PYTHON": sys.executable, "PATH": path}, capture_output=True, text=True,
                          timeout=300)


def _hint(stderr: str) -> str:
    return next(line.removeprefix("hint: ") for line in stderr.splitlines() if line.startswith("hint: "))


@pytest.mark.parametrize("arguments, again", [
    (["dreamzero-tiny", "arm_a", "runs/eval1"], "ardiff rollout dreamzero-tiny arm_a --out runs/eval1"),
    (["dreamzero-tiny", "runs/eval1"], None),
    (["--resume", "dreamzero-tiny", "arm_a", "runs/eval1"], "ardiff rollout dreamzero-tiny arm_a --out runs/eval1"),
    (["--resume", "runs/eval1"], None),
])
def test_a_run_folder_of_a_model_still_loading_given_as_an_episode_hints_the_rollout_that_starts_it(
        tmp_path, cli_env, arguments, again):
    # as CONFIG such a folder (only .lock: run.json is written once the model loaded) hinted the rollout that starts
    # its run again; as EPISODE (or to --resume without -o) it hinted `ardiff rollout --resume -o RUN`, which pasted
    # with the folder says "nothing to resume: runs/eval1/run.json does not exist". A .lock an older ardiff wrote
    # records nothing: the command line's config and episodes fill the command, which runs as pasted; where it gives
    # none, the hint says what nothing records (it gave CONFIG and EPISODE... to paste).
    run = tmp_path / "runs" / "eval1"
    run.mkdir(parents=True)
    (run / ".lock").write_text("12345\n")  # the pid alone, as an older ardiff wrote it
    episode(tmp_path / "arm_a", 1)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *arguments, "--format", "plain"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    hint = _hint(proc.stderr)
    assert "--resume" not in hint and "CONFIG" not in hint and "EPISODE" not in hint, hint
    if again is None:
        missing = "episodes" if arguments[0] == "dreamzero-tiny" else "config and episodes"
        given = "dreamzero-tiny " if missing == "episodes" else ""
        assert hint.endswith(" no run.json: its model was loading when it stopped, so there is nothing to resume, "
                             f"and nothing in the folder records its {missing} ({PID_ALONE}); to start its run "
                             f"again: ardiff rollout {given}with its {missing}, and --out runs/eval1"), proc.stderr
        return
    assert hint.endswith(" no run.json: its model was loading when it stopped, so there is nothing to resume; to "
                         f"start its run again: {again}"), proc.stderr
    pasted = _pasted(again + " --no-warmup", tmp_path, cli_env)
    assert pasted.returncode == 0 and (run / "run.json").is_file(), pasted.stderr
    assert ok_steps(run) == {("arm_a", 0)}


def test_a_run_stopped_while_its_model_loads_hints_what_works_pasted_as_it_is(tmp_path, cli_env):
    # A rollout holds its folder's .lock before its model loads; run.json comes after. Held there (as it imports the
    # module its run starts with: a FIFO no one writes yet), its folder, given as CONFIG, as EPISODE, or to --resume
    # without -o (the folder itself or ./runs, the folder of run folders that holds it), hinted "its model was loading
    # when it stopped (or is loading now)" and `ardiff rollout CONFIG EPISODE... --out runs/eval1` (the folder of runs:
    # `--resume -o RUN`, refused pasted with it). Now while it loads the hint names its pid, and once it is stopped
    # every hint gives the rollout its .lock recorded, which pasted as it is starts the run there.
    shim, hold, run = tmp_path / "shim", tmp_path / "hold", tmp_path / "runs" / "eval1"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_IMPORT)
    os.mkfifo(hold)
    episode(tmp_path / "arm_a", 1)
    held = {**cli_env, "HOLD": str(hold), "HOLD_MODULE": "ardiff_cli.io.kept",
            "PYTHONPATH": os.pathsep.join([str(shim), cli_env["PYTHONPATH"]])}
    loading = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", "arm_a", "--out",
                                "runs/eval1", "--no-warmup", "--format", "plain"], cwd=tmp_path, env=held, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    mistakes = [["runs/eval1"], ["dreamzero-tiny", "runs/eval1"], ["--resume", "runs/eval1"], ["--resume", "runs"],
                ["runs"], ["dreamzero-tiny", "runs"]]

    def hints() -> list[str]:
        found = []
        for arguments in mistakes:
            proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", *arguments, "--format", "plain"],
                                  env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 2, proc.stderr
            found.append(_hint(proc.stderr))
        return found

    writer = None
    try:
        writer = open_to_write(loading, hold)  # past its lock, before run.json
        assert sorted(os.listdir(run)) == [".lock"]
        for hint in hints():
            assert f"its model is loading now, in another ardiff rollout (pid {loading.pid}) that writes run.json " \
                   f"once it has loaded; wait for that rollout to end, or stop it (kill {loading.pid}), then give " \
                   "this command again" in hint, hint
            assert "--resume -o" not in hint and "CONFIG" not in hint, hint
        pasted = _pasted(f"kill {loading.pid}", tmp_path, cli_env)
        assert pasted.returncode == 0, pasted.stderr
        loading.communicate(timeout=300)
    finally:
        loading.kill()
        if writer is not None:
            os.close(writer)
    assert loading.returncode != 0 and sorted(os.listdir(run)) == [".lock"], loading.returncode
    again = f"ardiff rollout dreamzero-tiny {tmp_path / 'arm_a'} --no-warmup --out runs/eval1"
    for hint in hints():
        assert hint.endswith("has no run.json: its model was loading when it stopped, so there is nothing to resume; "
                             f"to start its run again: {again}"), hint
    # and given to --resume as it should be, which said "run without --resume", the command line's others unknown
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", "runs/eval1", "--format",
                           "plain"], env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and _hint(proc.stderr) == ("its model was loading when its run stopped; to start that "
                                                           f"run again: {again}"), proc.stderr
    pasted = _pasted(again, tmp_path, cli_env)
    assert pasted.returncode == 0 and (run / "run.json").is_file(), pasted.stderr
    assert ok_steps(run) == {("arm_a", 0)}
    # the folder of run folders, its one run started: that run's resume (it was `-o RUN`), which pasted finishes it
    (run / "summary.json").unlink()  # as a run killed before its end leaves it
    resume = "ardiff rollout --resume --out runs/eval1"
    mistakes = [["--resume", "runs"], ["runs"], ["dreamzero-tiny", "runs"]]
    assert hints() == [f"runs is a folder of ardiff run folders: give its one run as --out, not as CONFIG or EPISODE: "
                       f"{resume}", f"it is a folder of ardiff run folders (what a rollout wrote); to finish its one "
                       f"run: {resume}", f"pass the folders of step files the robots wrote; to finish a stopped run: "
                       f"{resume}"]
    pasted = _pasted(resume, tmp_path, cli_env)
    assert pasted.returncode == 0 and (run / "summary.json").is_file(), pasted.stderr


def test_a_run_refused_for_its_memory_budget_is_hinted_what_to_change_not_the_same_rollout(tmp_path, cli_env):
    # A new run whose one session does not fit its budget is refused as its model loads (exit 3), leaving only the
    # .lock that records its rollout. Its folder, given to --resume -o, as CONFIG or in a folder of runs, was hinted
    # "its model was loading when it stopped" and that rollout to start it again: refused, pasted, the same way.
    # The hints say the refusal's own advice, and that the rollout is to be changed so.
    episode(tmp_path / "arm_a", 1)
    command = [sys.executable, "-m", "ardiff_cli", "rollout"]
    refused = "ardiff rollout dreamzero-tiny {arm} --memory-budget {budget} --no-warmup --out runs/eval1"
    proc = subprocess.run([*command, "dreamzero-tiny", str(tmp_path / "arm_a"), "--memory-budget", "1KB",
                           "--no-warmup", "--out", "runs/eval1", "--format", "plain"], env=cli_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    advice = _hint(proc.stderr)
    assert advice.startswith("plan with a larger --memory-budget"), proc.stderr
    said = (f"its run was refused as its model loaded ({advice}); change that in the rollout refused, then run it "
            f"again: {refused.format(arm=tmp_path / 'arm_a', budget='1KB')}")
    for arguments in (["--resume", "--out", "runs/eval1"], ["runs/eval1"], ["--resume", "runs"]):
        proc = subprocess.run([*command, *arguments, "--format", "plain"], env=cli_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert _hint(proc.stderr).endswith(said) and "was loading" not in proc.stderr, proc.stderr
    proc = subprocess.run([*command, "--resume", "--out", "runs/eval1", "--format", "json"], env=cli_env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and json.loads(proc.stdout)["hint"] == said, proc.stdout
    # changed as the hint says, it runs there; its new start's record has no refusal
    pasted = _pasted(refused.format(arm=tmp_path / "arm_a", budget="1MiB"), tmp_path, cli_env)
    assert pasted.returncode == 0, pasted.stderr
    assert ok_steps(tmp_path / "runs" / "eval1") == {("arm_a", 0)}
    assert "refused" not in json.loads((tmp_path / "runs" / "eval1" / ".lock").read_text().splitlines()[1])


def test_a_restart_hint_pastes_paths_with_a_newline_or_bytes_the_locale_cannot_decode_as_they_are(tmp_path, cli_env):
    # The rollout a stopped run's .lock records, with its config in a folder named with a byte no locale decodes and
    # an episode folder whose name holds a newline: shell_word quoted the newline as it is ('arm<newline>b'), which the
    # hint's one line writes \x0a, so the pasted command named 'arm\x0ab' ("episode folder not found"). Each is bash's
    # $'...' of its bytes, and the hint pasted as it is starts the run.
    configs = Path(os.fsdecode(bytes(tmp_path) + b"/cfg \xff dir"))
    configs.mkdir()
    (configs / "fast.yaml").write_text(FAST_CONFIG)
    episode(tmp_path / "arm\nb 'q'", 1)
    config = os.path.join(os.fsdecode(b"cfg \xff dir"), "fast.yaml")  # relative, as typed
    _killed_while_loading(tmp_path, cli_env, [config, "arm\nb 'q'", "--out", "runs/eval1", "--no-warmup", "--order",
                                              "sequential", "--format", "plain"], cwd=tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "runs/eval1", "--format",
                           "plain"], env=cli_env, cwd=tmp_path, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    again = _hint(os.fsdecode(proc.stderr)).rpartition("to start its run again: ")[2]
    assert again.endswith(" --order sequential --no-warmup --out runs/eval1"), again
    assert "\\udc" not in again, again  # a byte as bash's $'...' writes it
    pasted = _pasted(again, tmp_path, cli_env)
    assert pasted.returncode == 0, pasted.stderr
    assert ok_steps(tmp_path / "runs" / "eval1") == {("arm_b 'q'", 0)}  # its name, the newline made '_'


@pytest.mark.parametrize("kind", ["empty", "pid alone", "FIFO", "folder", "link to a folder", "link to a FIFO",
                                  "link to a file"])
def test_a_run_folder_whose_lock_is_no_record_says_what_its_lock_is(tmp_path, cli_env, kind):
    # A run folder with only a .lock that records no rollout said of every one "its .lock was written by an older
    # ardiff": of an empty one too (a rollout on a file system that cannot lock leaves it so), and of a FIFO, a folder
    # or a link named .lock, which no ardiff wrote. Each is told as what it is; a new run there, which said of a FIFO
    # "cannot write the output folder: Invalid argument" and to free some space, and of a link to a folder "remove
    # that folder", names it and says to remove it, which pasted lets the run start. Nothing waits on the FIFO. The
    # hint of the run folder given as CONFIG or EPISODE says to remove such a .lock too: its rollout was refused so.
    # A link to a file (another run's .lock, say) was taken for the lock file, and that file truncated and written,
    # then locked: it is named as a link, and left as it was. The pid alone says that its rollout has ended: the
    # lock is free (a process holding it is told as loading now).
    run, lock = tmp_path / "runs" / "eval1", tmp_path / "runs" / "eval1" / ".lock"
    run.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    if kind in ("empty", "pid alone"):
        lock.write_text("" if kind == "empty" else "12345\n")
    elif kind == "folder":
        lock.mkdir()
    elif kind == "FIFO":
        os.mkfifo(lock)
    else:
        target = tmp_path / "elsewhere" / "target"
        if kind == "link to a file":
            target.write_text("12345\n")
        else:
            os.mkfifo(target) if kind == "link to a FIFO" else target.mkdir()
        lock.symlink_to(target)
    episode(tmp_path / "arm_a", 1)
    said = {"empty": "its .lock is empty (its rollout stopped as it took the lock, or ran on a file system that cannot "
                     "lock)",
            "pid alone": PID_ALONE,
            "FIFO": "its .lock is a FIFO, not the file ardiff writes",
            "folder": "its .lock is a folder, not the file ardiff writes",
            "link to a folder": f"its .lock is a link to {tmp_path / 'elsewhere' / 'target'}, a folder, not the file "
                                "ardiff writes",
            "link to a FIFO": f"its .lock is a link to {tmp_path / 'elsewhere' / 'target'}, a FIFO, not the file "
                              "ardiff writes",
            "link to a file": f"its .lock is a link to {tmp_path / 'elsewhere' / 'target'}, a file, not the file "
                              "ardiff writes"}[kind]
    rollout = [sys.executable, "-m", "ardiff_cli", "rollout", "--format", "plain"]
    proc = subprocess.run([*rollout, "runs/eval1"], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    remove = "" if kind in ("empty", "pid alone") else "remove its .lock (runs/eval1/.lock), then "
    assert _hint(proc.stderr) == ("it is an ardiff run folder (what a rollout wrote); it has no run.json: its model "
                                  "was loading when it stopped, so there is nothing to resume, and nothing in the "
                                  f"folder records its config and episodes ({said}); to start its run again: {remove}"
                                  "ardiff rollout with its config and episodes, and --out runs/eval1"), proc.stderr
    proc = subprocess.run([*rollout, "dreamzero-tiny", "arm_a", "runs/eval1"], env=cli_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert _hint(proc.stderr).endswith("; to start its run again: "
                                       f"{remove}ardiff rollout dreamzero-tiny arm_a --out runs/eval1"), proc.stderr
    proc = subprocess.run([*rollout, "--resume", "--out", "runs/eval1"], env=cli_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    start = "run without --resume to start a run in this folder"
    if kind not in ("empty", "pid alone"):
        start = f"remove its .lock (runs/eval1/.lock: {said.removeprefix('its .lock is ')}), then {start}"
    assert _hint(proc.stderr) == start, proc.stderr
    new = [*rollout, "dreamzero-tiny", "arm_a", "--out", "runs/eval1", "--no-warmup"]
    proc = subprocess.run(new, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if kind in ("empty", "pid alone"):  # the lock file of a run: locked, and the run goes on
        assert proc.returncode == 0, proc.stderr
        assert ok_steps(run) == {("arm_a", 0)}
        return
    what = said.removeprefix("its .lock is ").removesuffix(", not the file ardiff writes")
    removed = "link" if kind.startswith("link") else kind
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"Error: --out runs/eval1: its .lock is {what}, not the file ardiff locks\nhint: remove "
                           f"that {removed} (runs/eval1/.lock): ardiff makes .lock itself, a file it holds locked to "
                           "keep a second rollout off the run\n")
    pasted = _pasted(f"rm -r runs/eval1/.lock && {shlex.join(['ardiff', *new[3:]])}", tmp_path, cli_env)
    assert pasted.returncode == 0, pasted.stderr
    assert ok_steps(run) == {("arm_a", 0)}
    if kind == "link to a file":
        assert (tmp_path / "elsewhere" / "target").read_text() == "12345\n"


def test_a_lock_holding_the_pid_alone_says_whether_its_rollout_runs(tmp_path, cli_env):
    # A .lock holding the pid alone (an older ardiff's; a resume's) was said to be "written by an older ardiff",
    # whatever ran. The lock tells: a process of that pid that does not hold it is not the rollout (the pid was
    # given to another), which has ended; one holding it (an older ardiff loading its model) is loading now.
    run = tmp_path / "runs" / "eval1"
    run.mkdir(parents=True)
    episode(tmp_path / "arm_a", 1)
    hold = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, f'{os.getpid()}\\n'.encode())\nprint(flush=True)\n"
            "sys.stdin.read()\n")
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (run / ".lock").write_text(f"{other.pid}\n")  # a live pid, no lock held
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "runs/eval1", "--format", "plain"],
                              env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert _hint(proc.stderr).endswith(f"records its config and episodes (its .lock holds only the pid of the "
                                           f"rollout that wrote it ({other.pid}: an older ardiff, or a resume, records "
                                           "no more), and no process holds its lock: that rollout has ended); to start "
                                           "its run again: ardiff rollout with its config and episodes, and --out "
                                           "runs/eval1"), proc.stderr
    finally:
        other.communicate(b"")
    (run / ".lock").unlink()
    older = subprocess.Popen([sys.executable, "-c", hold, str(run / ".lock")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        older.stdout.readline()  # locked, its pid written
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "runs/eval1", "--format", "plain"],
                              env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert f"its model is loading now, in another ardiff rollout (pid {older.pid})" in _hint(proc.stderr), \
            proc.stderr
    finally:
        older.communicate(b"")


def test_a_lock_that_is_a_link_to_a_file_another_process_holds_is_named_as_the_link(tmp_path, cli_env):
    # OUT/.lock a link to another run's .lock, held by that run's rollout: the lock was looked at through the link,
    # and the folder said to be in use by that rollout ("its model is loading now ... (kill PID)", a resume "in use by
    # another ardiff rollout (pid PID)"): a hint to stop another run's rollout, after which this folder's was still
    # refused, as the link it is. Never followed: it is named as the link, to remove.
    run, other = tmp_path / "runs" / "eval1", tmp_path / "runs" / "other"
    run.mkdir(parents=True)
    other.mkdir()
    (run / ".lock").symlink_to(other / ".lock")
    hold = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, f'{os.getpid()}\\n'.encode())\nprint(flush=True)\n"
            "sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(other / ".lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # locked, its pid written
        rollout = [sys.executable, "-m", "ardiff_cli", "rollout", "--format", "plain"]
        proc = subprocess.run([*rollout, "runs/eval1"], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert _hint(proc.stderr).endswith(
            f"records its config and episodes (its .lock is a link to {other / '.lock'}, a file, not the file ardiff "
            "writes); to start its run again: remove its .lock (runs/eval1/.lock), then ardiff rollout with its "
            "config and episodes, and --out runs/eval1"), proc.stderr
        proc = subprocess.run([*rollout, "--resume", "--out", "runs/eval1"], env=cli_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert _hint(proc.stderr) == (f"remove its .lock (runs/eval1/.lock: a link to {other / '.lock'}, a file, not "
                                      "the file ardiff writes), then run without --resume to start a run in this "
                                      "folder"), proc.stderr
    finally:
        holder.communicate(b"")


def test_a_lock_that_is_a_link_to_nothing_creates_nothing_where_it_leads(tmp_path, cli_env):
    # OUT/.lock a link to a path that does not exist (a disk not mounted, a folder removed): the rollout created the
    # link's target, outside the run's folder, and wrote its pid there. It is refused as the link it is, as a link
    # that loops is, nothing created; the resume's hint says to remove it, and the rollout pasted after that runs.
    run, lock, target = tmp_path / "runs" / "eval1", tmp_path / "runs" / "eval1" / ".lock", tmp_path / "gone" / "x"
    run.mkdir(parents=True)
    (tmp_path / "gone").mkdir()
    lock.symlink_to(target)
    episode(tmp_path / "arm_a", 1)
    rollout = [sys.executable, "-m", "ardiff_cli", "rollout", "--format", "plain"]
    new = [*rollout, "dreamzero-tiny", "arm_a", "--out", "runs/eval1", "--no-warmup"]
    proc = subprocess.run(new, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"Error: --out runs/eval1: its .lock is a link to {target}, which does not exist\nhint: "
                           "remove that link (runs/eval1/.lock): ardiff makes .lock itself, a file it holds locked to "
                           "keep a second rollout off the run\n")
    assert not os.path.lexists(target) and os.listdir(run) == [".lock"]
    proc = subprocess.run([*rollout, "--resume", "--out", "runs/eval1"], env=cli_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert _hint(proc.stderr) == (f"remove its .lock (runs/eval1/.lock: a link to {target}, which does not exist, not "
                                  "the file ardiff writes), then run without --resume to start a run in this folder")
    assert not os.path.lexists(target)
    pasted = _pasted(f"rm runs/eval1/.lock && {shlex.join(['ardiff', *new[3:]])}", tmp_path, cli_env)
    assert pasted.returncode == 0, pasted.stderr
    assert ok_steps(run) == {("arm_a", 0)} and not os.path.lexists(target)


def _killed_while_loading(tmp_path: Path, cli_env: dict[str, str], arguments: list[str], *, cwd: Path,
                         pythonpath: list[str] = ()) -> Path:
    """A rollout given ``arguments`` (PYTHONPATH: ``pythonpath``, then the tests'), killed (-9) while its model
    loads: past its lock, whose record starts the run again, before run.json. Returns the folder of the
    sitecustomize that held it (first on its PYTHONPATH)."""
    shim, hold = tmp_path / "shim", tmp_path / "hold"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_IMPORT)
    os.mkfifo(hold)
    held = {**cli_env, "HOLD": str(hold), "HOLD_MODULE": "ardiff_cli.io.kept",
            "PYTHONPATH": os.pathsep.join([str(shim), *pythonpath, cli_env["PYTHONPATH"]])}
    loading = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", *arguments], cwd=cwd, env=held,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    writer = None
    try:
        writer = open_to_write(loading, hold)  # past its lock, before run.json
        loading.kill()
        loading.wait(timeout=300)
    finally:
        loading.kill()
        if writer is not None:
            os.close(writer)
    return shim


MY_PIPELINE = """\
from pipelines.dreamzero.pipeline import DreamZeroPipeline


class Mine(DreamZeroPipeline):
    pass
"""


@pytest.mark.parametrize("where", ["working folder", "PYTHONPATH entries", "working folder named with ':'",
                                   "PYTHONPATH entry in a working folder named with ':'"])
def test_a_restart_hint_of_a_pipeline_module_found_in_the_working_folder_pastes_from_another_folder(
        tmp_path, cli_env, where):
    # `--pipeline mypipe:Mine`, a module in the folder the rollout was started in (`python -m` puts it on sys.path),
    # was recorded as typed: the rollout the hint gave, pasted in another folder (or a root shell), could not import
    # it. The .lock records the folders Python searched before what is installed (the working folder, PYTHONPATH's
    # entries made absolute), and the hint carries them as PYTHONPATH; pasted elsewhere, it starts the run. A module
    # on a relative PYTHONPATH entry that imports a module of another entry (PYTHONPATH=../lab:../libs) was given its
    # own folder alone: pasted, `No module named 'helper'`. The PYTHONPATH the tests give is the repository's and
    # tests/, with the working folder (an empty entry). A working folder named with ':', which PYTHONPATH cannot
    # carry, was recorded split in two at it (a relative half, dropped): pasted, `No module named 'mypipe'`. The
    # hint enters it first (env -C), and puts '.' on PYTHONPATH, --out absolute; a PYTHONPATH entry inside it
    # (PYTHONPATH=src), named with ':' too, is carried relative to it (it was left out, in a comment: pasted, `No
    # module named 'mypipe'`).
    lab = tmp_path / ("lab:1" if where.endswith("':'") else "lab")
    elsewhere, run = tmp_path / "elsewhere", tmp_path / "lab dir's runs" / "eval1"
    libs, started = tmp_path / "libs", lab if "working folder" in where else tmp_path / "started"
    inner = where.startswith("PYTHONPATH entry in")  # the module in lab:1/src, PYTHONPATH=src
    home = lab / "src" if inner else lab
    for folder in (lab, elsewhere, libs, started, home):
        folder.mkdir(exist_ok=True)
    (home / "mypipe.py").write_text(MY_PIPELINE if where != "PYTHONPATH entries" else f"import helper\n{MY_PIPELINE}")
    (libs / "helper.py").write_text("")
    episode(tmp_path / "arm_a", 1)
    pythonpath = ["../lab", "../libs"] if where == "PYTHONPATH entries" else ["src"] if inner else []
    shim = _killed_while_loading(tmp_path, cli_env, ["dreamzero-tiny", "../arm_a", "--out", str(run), "--pipeline",
                                                     "mypipe:Mine", "--no-warmup", "--format", "plain"], cwd=started,
                                 pythonpath=pythonpath)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run), "--format",
                           "plain"], env=cli_env, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    again = _hint(proc.stderr).rpartition("to start that run again: ")[2]
    searched = [str(folder) for folder in [started, shim] + ([] if where != "PYTHONPATH entries" else [lab, libs])]
    searched += ["src"] if inner else []  # inside the folder entered first: relative to it
    searched += [os.path.join(started, entry) for entry in cli_env["PYTHONPATH"].split(os.pathsep) if entry]  # '':
    searched = list(dict.fromkeys(searched))  # started, again; each folder once
    rollout = (f"ardiff rollout dreamzero-tiny {tmp_path / 'arm_a'} --pipeline mypipe:Mine --no-warmup --out "
               f"{shlex.quote(str(run))}")
    if ":" in lab.name:
        searched[0] = "."
        assert again == f"env -C {lab} PYTHONPATH={shlex.quote(os.pathsep.join(searched))} {rollout}", proc.stderr
    else:
        assert again == f"PYTHONPATH={shlex.quote(os.pathsep.join(searched))} {rollout}", proc.stderr
    pasted = _pasted(again, elsewhere, cli_env, script=True)
    assert pasted.returncode == 0, pasted.stderr
    assert ok_steps(run) == {("arm_a", 0)}


def test_a_new_run_inside_another_runs_folder_is_refused_naming_it(tmp_path, cli_env):
    # `-o runs/eval1/episodes/retry` wrote a second run among the first's episode outputs (and `-o runs/eval1/x`
    # inside its folder): refused before anything is written there, naming the run it is inside, with an --out
    # beside that run to paste; run from inside the run's folder, the default ./ardiff-runs is refused alike
    episode(tmp_path / "arm_a", 1)
    rollout = [sys.executable, "-m", "ardiff_cli", "rollout", "--no-warmup", "--format", "plain"]
    proc = subprocess.run([*rollout, "dreamzero-tiny", "arm_a", "--out", "runs/eval1"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    outer = tmp_path / "runs" / "eval1"
    for out, where in (("runs/eval1/episodes/retry", " (its episodes/ folder)"),
                       ("runs/eval1/episodes/arm_a/retry", " (its episodes/ folder)"), ("runs/eval1/retry", "")):
        proc = subprocess.run([*rollout, "dreamzero-tiny", "arm_a", "--out", out],
                              env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"Error: --out {out} is inside the ardiff run folder runs/eval1{where}: a new run "
                               "written inside another is mixed with its outputs, and moved or deleted with it\n"
                               "hint: choose an --out outside runs/eval1, such as --out runs/retry\n")
        assert not (tmp_path / out).exists()
    proc = subprocess.run([*rollout, "dreamzero-tiny", "../../arm_a"],
                          env=cli_env, cwd=outer, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"Error: the default output folder {outer / 'ardiff-runs'} (no --out given) is inside the ardiff run " \
           f"folder {outer}: " in proc.stderr
    assert not (outer / "ardiff-runs").exists()
    proc = _pasted("ardiff rollout dreamzero-tiny arm_a --no-warmup --out runs/retry", tmp_path, cli_env)
    assert proc.returncode == 0 and ok_steps(tmp_path / "runs" / "retry") == {("arm_a", 0)}, proc.stderr
    # the first run's episodes/ holds its own outputs alone
    assert sorted(p.name for p in (outer / "episodes").iterdir()) == ["arm_a"]


@pytest.mark.parametrize("given, what", [("arm_a/episode.yaml", "the episode.yaml (its prompt and metadata)"),
                                         ("arm_a/step_000000.safetensors", "a step file (one step's observations)")])
def test_an_episode_file_given_as_config_says_so_and_gives_the_rollout_that_reads_it(tmp_path, cli_env, given,
                                                                                       what):
    # `ardiff rollout arm_a/episode.yaml` said "arm_a/episode.yaml: unknown key 'prompt'" with the config's keys as
    # its hint; a step file "is a .safetensors file, not a config"
    episode(tmp_path / "arm_a", 1)
    episode(tmp_path / "arm_b", 1)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", given, "arm_b", "--format", "plain"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    again = "ardiff rollout dreamzero-tiny arm_a arm_b --format plain"
    assert proc.stderr == (f"Error: CONFIG '{given}' is {what} of the episode arm_a, not a config: the first argument "
                           "is a config file or a built-in config name\nhint: pass the config first, then the "
                           f"episode's folder: {again}\n")
    pasted = _pasted(f"{again} --no-warmup --out runs/eval1", tmp_path, cli_env)
    assert pasted.returncode == 0, pasted.stderr
    assert ok_steps(tmp_path / "runs" / "eval1") == {("arm_a", 0), ("arm_b", 0)}


def test_a_config_file_named_episode_yaml_is_a_config_where_no_episode_is_beside_it(tmp_path, cli_env):
    # configs/episode.yaml, a config (the file name a user chose): it was refused as "the episode.yaml (its prompt and
    # metadata) of the episode configs", hint `ardiff rollout dreamzero-tiny configs arm_a`, which fails pasted
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "episode.yaml").write_text(FAST_CONFIG)
    episode(tmp_path / "arm_a", 1)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "configs/episode.yaml", "arm_a", "--out",
                           "runs/eval1", "--no-warmup", "--format", "plain"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert ok_steps(tmp_path / "runs" / "eval1") == {("arm_a", 0)}


@pytest.mark.parametrize("before", [[], ["dreamzero-tiny"]])
def test_resume_given_the_run_folder_without_out_gives_the_resume_to_paste(tmp_path, cli_env, before):
    # `ardiff rollout --resume runs/eval1` (-o forgotten) said "--resume needs --out DIR", hint "the run printed it as
    # 'outputs: DIR'": the folder it was given is that DIR. The resume to paste keeps the options given to this one.
    run = a_run_of(tmp_path / "eval1", [episode(tmp_path / "arm_a", 1)])
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", *before, str(run),
                           "--session-capacity", "1", "--preview", "--format", "json"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout)
    assert (error["kind"], error["message"]) == ("config_error", "--resume needs --out DIR: the folder of the run to "
                                                                 "continue"), error
    assert error["hint"] == (f"{run} is a run's folder: give it as --out, not as CONFIG or EPISODE: ardiff rollout "
                             f"--resume --out {run} --preview --session-capacity 1"), error


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("command", ["rollout", "warmup"])
def test_a_step_file_given_as_config_says_what_it_is(tmp_path, cli_env, command, suffix):
    # `ardiff rollout data/arm_a/step_000000.safetensors` (the config forgotten) read "not UTF-8 text (byte 0:
    # b'\x80')", hint "save the config as UTF-8 YAML", of a file that was never meant to be one.
    step = episode(tmp_path / "arm_a", 1) / "step_000000.safetensors"
    if suffix == ".npz":  # the other step file format
        step = Path(write_episode(tmp_path / "npz", [good(0, 0)], prompt="p", format="npz")[0])
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, str(step), "--format", "plain"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    message, _, hint = proc.stderr.partition("\nhint: ")
    # it is named a step file of its episode (not "a .safetensors file", as a checkpoint is)
    assert message == (f"Error: CONFIG '{step}' is a step file (one step's observations) of the episode {step.parent}, "
                       "not a config: the first argument is a config file or a built-in config name"), proc.stderr
    assert hint == (f"pass the config first, then the episode's folder: ardiff rollout dreamzero-tiny {step.parent} "
                    "--format plain\n" if command == "rollout"
                    else "pass a config, e.g. ardiff warmup dreamzero-tiny\n")  # not the file


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt", ".bin"])
def test_a_torch_checkpoint_given_as_config_says_what_it_is(tmp_path, cli_env, suffix):
    """`ardiff warmup model.pt` read "not UTF-8 text", hint "save the config as UTF-8 YAML", of a file that was
    never meant to be one: it is named a checkpoint, which goes in the config as .safetensors."""
    weights = tmp_path / f"model{suffix}"
    weights.write_bytes(b"\x80\x02}q\x00.")  # a pickle, as torch.save's legacy format begins
    for command in ("rollout", "warmup", "inspect-capacity"):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, str(weights), "--format", "plain"],
                              env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"Error: CONFIG '{weights}' is a {suffix} file, not a config: the first argument is a "
                               f"config file or a built-in config name\nhint: pass a config, e.g. ardiff {command} "
                               "dreamzero-tiny; a checkpoint goes in the config's `checkpoint:` field, converted to "
                               ".safetensors (ardiff never unpickles a file)\n"), proc.stderr


def test_episodes_given_before_the_config_get_a_hint_that_keeps_the_config(tmp_path, cli_env):
    # `ardiff rollout data my_config.yaml`: the hint said `ardiff rollout dreamzero-tiny data`, which runs another
    # model than the user's.
    data = episode(tmp_path / "data" / "arm_a", 1).parent
    config = tmp_path / "my_config.yaml"
    config.write_text("pipeline: causal_world\nmodel: {preset: tiny}\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data), str(config), "--format", "plain"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"hint: pass the config first: ardiff rollout {config} {data} --format plain\n"), \
        proc.stderr


def test_a_hint_that_puts_the_config_first_keeps_the_options_given(tmp_path, cli_env):
    # `ardiff rollout data -o "runs/eval 1" --order sequential` (the config forgotten) was told `ardiff rollout
    # dreamzero-tiny data`: pasted, it ran into ./ardiff-runs/<time> in round-robin, the options given left out.
    data = episode(tmp_path / "data" / "arm_a", 1).parent
    out = tmp_path / "runs" / "eval 1"
    options = ["-o", str(out), "--order", "sequential", "--no-warmup", "--format", "plain"]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data), *options], cwd=tmp_path,
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    hint = proc.stderr.splitlines()[-1]
    assert hint.startswith("hint: pass the config first: "), proc.stderr
    words = shlex.split(hint.removeprefix("hint: pass the config first: "))
    assert words == ["ardiff", "rollout", "dreamzero-tiny", str(data), *options], hint
    pasted = subprocess.run([sys.executable, "-m", "ardiff_cli", *words[1:]], cwd=tmp_path, env=cli_env,
                            capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr
    assert json.loads((out / "summary.json").read_text())["order"] == "sequential"
    # a step file given as CONFIG, and a value given with '=' or after '--': the same
    step = data / "arm_a" / "step_000000.safetensors"
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--out=x", "--follow", "--", str(step)],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("hint: pass the config first, then the episode's folder: ardiff rollout dreamzero-tiny "
                                f"{data / 'arm_a'} --out=x --follow\n"), proc.stderr
    # short options run together, the last taking the next word (`-qo DIR`): the hint gave `-qo --no-warmup`, which
    # pasted, took --no-warmup for the folder
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data), "-qo", "runs/q", "--no-warmup"],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"hint: pass the config first: ardiff rollout dreamzero-tiny {data} -qo runs/q "
                                "--no-warmup\n"), proc.stderr


def test_a_camera_frame_written_as_floats_is_hinted_how_to_write_it_as_uint8(tmp_path, cli_env):
    # a frame in 0..1 floats (what most image libraries hand a recorder) said "'wrist_image' has dtype float32,
    # expected uint8", hint "fields: exterior_image_0, ...": the fields the user had, not how to convert them.
    frame = good(0, 0)["wrist_image"]
    assert frame.dtype == np.uint8
    data = episode(tmp_path / "arm_a", 1, step0={"wrist_image": frame.astype(np.float32) / 255}).parent
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", str(data / "arm_a"),
                           "--out", str(tmp_path / "run"), "--no-warmup", "--format", "plain"], env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "'wrist_image' has dtype float32, expected uint8" in proc.stderr, proc.stderr
    assert ("; 'wrist_image' takes uint8, 0 to 255 (a camera frame's pixels): from floats in [0, 1], write "
            "np.clip(np.rint(np.asarray(x) * 255), 0, 255).astype(np.uint8)\n") in proc.stderr, proc.stderr


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("dtype, shape", [("int64", (4, 3, 16, 16)), ("float32", (3, 16, 16)), ("int32", (16, 16, 3)),
                                          ("float64", (2, 3, 16, 16)), ("uint8", (3, 16, 16))])
def test_a_camera_frame_hint_run_on_the_frames_it_names_makes_frames_the_schema_takes(library, dtype, shape):
    # The hints for frames as floats, as integers ("torch's .long()", the README says) or channel-first are numpy
    # calls on x: x a torch tensor, np.clip(x, ...) gave a tensor, which has no .astype, and np.moveaxis(x, ...)
    # called the tensor's own transpose ("argument 'dim0' must be int"). Each, run in turn on x, gives frames taken.
    import torch
    from pipelines.dreamzero import observation_schema

    pixels = np.random.default_rng(0).integers(0, 256, shape)
    frames = pixels / 255 if dtype.startswith("float") else pixels
    x = torch.from_numpy(frames.astype(dtype)) if library == "torch" else frames.astype(dtype)
    arrays = {**good(0, 0), "prompt": "p", "wrist_image": x}
    with pytest.raises(ObservationError) as err:
        validate_observation(observation_schema(), arrays, where="w")
    fixes = re.findall(r"write (np\.[^;]*)", err.value.hint)
    assert len(fixes) == (dtype != "uint8") + (shape[-1] != 3), err.value.hint
    for fix in fixes:
        x = eval(fix, {"np": np, "x": x})
    valid = validate_observation(observation_schema(), {**arrays, "wrist_image": x}, where="w")
    np.testing.assert_array_equal(valid["wrist_image"], pixels if shape[-1] == 3 else np.moveaxis(pixels, -3, -1))


def test_hints_that_show_a_command_quote_its_paths_and_keep_the_episodes_order(tmp_path, cli_env):
    # `ardiff rollout "my data/épisode un" "my data/ep 2"` was told `ardiff rollout dreamzero-tiny my data/ep 2 my
    # data/épisode un`: split at the spaces, and the first episode moved last. The same of --out's "continue it".
    first, second = episode(tmp_path / "my data" / "épisode un", 1), episode(tmp_path / "my data" / "ep 2", 1)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(first), str(second), "--format",
                           "plain"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"hint: pass the config first: ardiff rollout dreamzero-tiny '{first}' '{second}' "
                                "--format plain\n")
    out = tmp_path / "out dir" / "r s"
    for expected in (0, 2):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", str(first),
                               "--out", str(out), "--no-warmup", "--format", "plain"], env=cli_env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == expected, proc.stderr
    assert f"hint: continue it with: ardiff rollout --resume --out '{out}'; or choose another --out" in proc.stderr


def test_resume_with_other_episodes_says_which_were_given(tmp_path, cli_env):
    # It named only the run's episodes ("...: ['arm_a', 'arm_b']"), not what the command line gave instead.
    folders = [episode(tmp_path / name, 1) for name in ("arm_a", "arm_b")]
    run = a_run_of(tmp_path / "run", folders)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "dreamzero-tiny", str(folders[0]),
                           "--resume", "-o", str(run), "--format", "plain"], env=cli_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"Error: the episodes differ from those of the run in {run}: expected ['arm_a', "
                                  "'arm_b'], got ['arm_a']\nhint: resume with the same EPISODE arguments"), proc.stderr


@pytest.mark.parametrize(("recorded", "given", "message", "hint"), [
    (None, ["--pipeline", "causal_world"], "the run used its config's pipeline, not --pipeline causal_world",
     "resume without --pipeline"),
    ("my_lab.models:Mine", ["--pipeline", "causal_world"],
     "--pipeline 'causal_world' differs from the run's 'my_lab.models:Mine'",
     "resume with --pipeline my_lab.models:Mine"),
    ("my_lab.models:Mine", [], "the run used --pipeline my_lab.models:Mine; ardiff imports code only when the command "
                               "line names it", "resume with --pipeline my_lab.models:Mine"),
])
def test_a_resume_runs_the_pipeline_the_run_ran_and_imports_only_what_it_is_told(tmp_path, cli_env, recorded, given,
                                                                                 message, hint):
    # Another pipeline would mix two models' outputs in one run; and run.json naming a module is no reason to
    # import it. Refused before anything is imported or loaded.
    run = a_run_of(tmp_path / "run", [episode(tmp_path / "arm_a", 1)])
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "pipeline_option": recorded}))
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", str(run), *given,
                           "--format", "plain"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"Error: {message}\nhint: {hint}\n", proc.stderr


def test_a_resume_whose_episode_folders_are_gone_names_the_first_and_counts_the_others(tmp_path, cli_env):
    # Refused before the model loads: the first missing folder by name, and how many more are gone, so that all of
    # them are put back at once rather than one per attempt.
    folders = [episode(tmp_path / name, 1) for name in ("arm_a", "arm_b", "arm_c")]
    run = a_run_of(tmp_path / "run", folders)
    resume = [sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", str(run), "--format", "plain"]
    for gone, first, more in (([], "arm_b", ""), (["arm_c"], "arm_b", " (and 1 more episode folder)"),
                              (["arm_a"], "arm_a", " (and 2 more episode folders)")):
        for name in [first, *gone]:
            if (tmp_path / name).exists():
                (tmp_path / name).rename(tmp_path / f"{name}.moved")
        proc = subprocess.run(resume, env=cli_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"Error: episode {first!r} of this run: its folder {tmp_path / first} is gone"
                                      f"{more}; {run / 'run.json'} records where the run last found each episode's "
                                      "folder (where it started, or where --follow followed its rename)\nhint: put it "
                                      "back at that path"), proc.stderr
    assert not (run / "results.jsonl").exists()


SCHEMA = ObservationSchema((
    ObservationField("image", "uint8", ((None, None, 3),), aliases=("observation/image",)),
    ObservationField("joints", "float32", ((7,),)),
    ObservationField("gripper", "float32", ((1,),), required=False),
), prompt_aliases=("language_instruction",))


def observation(**changes):
    return {"image": np.zeros((4, 4, 3), np.uint8), "joints": np.zeros(7, np.float32), "prompt": "p", **changes}


def problems(arrays) -> str:
    with pytest.raises(ObservationError) as info:
        validate_observation(SCHEMA, arrays, where="w")
    return str(info.value)


def test_a_bfloat16_tensor_is_read_as_floats_and_cast_to_the_fields_dtype():
    import torch

    out = validate_observation(SCHEMA, observation(joints=torch.full((7,), 0.5, dtype=torch.bfloat16)), where="w")
    assert out["joints"].dtype == np.float32 and out["joints"].tolist() == [0.5] * 7


@pytest.mark.parametrize(("joints", "image", "message"), [
    (np.zeros(6, np.float32), None, "w: 'joints' has shape (6,), expected (7,)"),
    (np.zeros((7, 1), np.float32), None, "w: 'joints' has shape (7, 1), expected (7,)"),
    # * is positive: (0, 4, 3) reads like a match of (*, *, 3) unless the message says why it is not
    (None, np.zeros((0, 4, 3), np.uint8),
     "w: 'image' has shape (0, 4, 3), expected (*, *, 3) (an empty array: each * is a size of at least 1)"),
    (None, np.zeros((4, 0, 4), np.uint8),
     "w: 'image' has shape (4, 0, 4), expected (*, *, 3) (an empty array: each * is a size of at least 1)"),
    (np.zeros(0, np.float32), None, "w: 'joints' has shape (0,), expected (7,)"),
])
def test_shapes_are_matched_whole_and_a_star_is_a_positive_size(joints, image, message):
    changes = {"joints": joints} if joints is not None else {"image": image}
    assert problems(observation(**changes)) == message


def test_an_optional_field_may_be_absent_and_a_prompt_of_the_wrong_type_is_not_also_missing():
    assert set(validate_observation(SCHEMA, observation(), where="w")) == {"image", "joints", "prompt"}
    assert problems(observation(prompt=5)) == "w: prompt 'prompt' must be a string, got int"


def test_non_finite_values_are_counted_by_kind_and_the_first_one_is_located():
    """A sensor dropout shows as several NaN and Inf values: the message counts each kind and points at the first, where
    the user looks in the recording."""
    joints = np.array([0, np.nan, 0, np.inf, 0, -np.inf, 0], np.float32)
    assert problems(observation(joints=joints)) == (
        "w: 'joints' has 1 NaN and 2 Inf values (first at index (1,)), expected finite numbers")


def test_a_float64_past_float32s_range_is_refused_not_cast_to_inf():
    message = problems(observation(joints=np.array([0, 0, 0, 1e39, 0, 0, 0], np.float64)))
    assert message == ("w: 'joints' has 1 value past float32's range (first at index (3,): 1e+39), expected finite "
                       "numbers of magnitude up to 3.4e+38")


def test_a_non_finite_value_gets_the_hint_to_fix_or_drop_the_step():
    with pytest.raises(ObservationError) as info:
        validate_observation(SCHEMA, observation(joints=np.full(7, np.nan, np.float32)), where="w")
    assert "ardiff never feeds non-finite values to the model" in info.value.hint


def test_schema_problems_of_shapes_and_shared_keys():
    ok = ObservationField("x", "float32", ((0,), (None, 3)))  # a declared size of 0 is a size
    assert ObservationSchema((ok,)).problems() == []
    no_shapes = ObservationField("x", "float32", ())
    assert ObservationSchema((no_shapes,)).problems() == [
        "field 'x': shapes must be a tuple of accepted shapes, each a tuple of sizes or None (any size), such as "
        "((None, None, 3),), got ()"]
    shared = (ObservationField("a", "float32", ((1,),), aliases=("cam",)),
              ObservationField("b", "float32", ((1,),), aliases=("cam",)))
    assert ObservationSchema(shared).problems() == ["key 'cam' names two fields"]


def test_a_schema_with_a_wrong_field_prompt_key_dtype_or_size_is_a_problem_named_for_its_author():
    """A pipeline's schema holding something other than ObservationFields, a field without a name, a prompt key that
    is not text, a dtype numpy does not name ("float") or a negative size otherwise fails every step file as if the
    file were at fault (or crashes in numpy): problems() names each, so the author is told."""
    joints = ObservationField("joints", "float32", ((7,),))
    assert ObservationSchema((joints, ("joints", "float32"))).problems() == [
        "fields must be a tuple of ObservationField, got (ObservationField(name='joints', dtype=...ases=(), "
        "required=True, description=''), ('joints', 'float32'))"]
    assert ObservationSchema((joints,), prompt_key=None).problems() == ["prompt_key must be text, got None"]
    assert ObservationSchema((ObservationField("", "float32", ((7,),)),)).problems() == [
        "field '': its name must be non-empty text"]  # no step file could give it
    (problem,) = ObservationSchema((ObservationField("j", "float", ((7,),)),)).problems()
    assert problem.startswith("field 'j': dtype must be the name of one, such as 'uint8' or 'float32' (bool, ")
    assert problem.endswith("float64), got 'float'")
    assert ObservationSchema((ObservationField("j", "float32", ((-1,),)),)).problems() == [
        "field 'j': shapes must be a tuple of accepted shapes, each a tuple of sizes or None (any size), such as "
        "((None, None, 3),), got ((-1,),)"]


def test_a_prompt_given_under_two_keys_is_refused_not_one_silently_dropped():
    assert problems(observation(language_instruction="place it")) == (
        "w: prompt given twice, differently: 'prompt' is 'p', 'language_instruction' is 'place it'")
    assert problems(observation(language_instruction=["p"])) == (
        "w: prompt given twice, differently: 'prompt' is 'p', 'language_instruction' is ['p']")


def test_one_prompt_under_two_keys_is_one_prompt_as_in_a_step_file():
    """`prompt` and `language_instruction` giving one text was refused as "given twice" in a request (a warmup
    request too), where a step file's metadata giving both runs: both run with it, under the prompt key."""
    out = validate_observation(SCHEMA, observation(language_instruction="p"), where="w")
    assert list(out) == ["image", "joints", "prompt"] and out["prompt"] == "p"


JOINTS = ObservationField("joints", "float32", ((7,),))


@pytest.mark.parametrize(("schema", "problem"), [
    # aliases=None: problems() itself raised TypeError ("Value after * must be an iterable"): 'a bug in ardiff'
    (ObservationSchema((ObservationField("joints", "float32", ((7,),), aliases=None),)),
     "field 'joints': aliases must be a tuple of keys (text), got None"),
    # prompt_aliases=None: every request failed with that TypeError, blamed on the forward
    (ObservationSchema((JOINTS,), prompt_aliases=None), "prompt_aliases must be a tuple of keys (text), got None"),
    # ("instruction") for ("instruction",): each letter became a prompt key, and a step's 'i' was taken for its prompt
    (ObservationSchema((JOINTS,), prompt_aliases="instruction"),
     "prompt_aliases must be a tuple of keys (text), got 'instruction'"),
])
def test_a_schema_whose_aliases_are_not_a_tuple_of_keys_is_a_problem_not_a_crash(schema, problem):
    assert schema.problems() == [problem]
