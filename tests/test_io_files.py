"""Episode files: writing from arrays, reading back, discovery, atomic writes and results.jsonl."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from ardiff_cli.io import end_episode, read_step, write_episode, write_step
from ardiff_cli.io.atomic import (JsonlAppender, atomic_write_bytes, read_jsonl, remove_temporaries, temporary_pattern,
                                  truncate_partial_line)
from ardiff_cli.io.episode import discover_episodes, scan_steps, step_number
from ardiff_cli.io.step_file import step_sha256
from ardiff_cli.io.kept import drop_kept, kept_for, read_kept, write_kept
from ardiff_cli.io.png import encode_png, evenly_spaced, preview_strip
from ardiff_cli.io.run import RunFolder, build_summary, percentiles
from ardiff_cli.runtime.errors import ConfigError, ObservationError


def arrays(step: int) -> dict[str, np.ndarray]:
    return {"image": np.full((4, 6, 3), step, np.uint8), "joints": np.arange(7, dtype=np.float32) + step}


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_write_then_read_episode_round_trips(tmp_path, fmt):
    paths = write_episode(tmp_path / "ep", [arrays(0), arrays(1), arrays(2)], prompt="pick", format=fmt)
    assert [p.name for p in paths] == [f"step_00000{i}.{fmt}" for i in range(3)]
    assert (tmp_path / "ep" / "END").exists()
    assert "prompt: pick" in (tmp_path / "ep" / "episode.yaml").read_text()
    for i, path in enumerate(paths):
        raw = read_step(path)
        assert set(raw.arrays) == {"image", "joints"}
        np.testing.assert_array_equal(raw.arrays["image"], arrays(i)["image"])
        np.testing.assert_array_equal(raw.arrays["joints"], arrays(i)["joints"])


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_a_view_is_written_as_it_reads(tmp_path, fmt):
    # safetensors.numpy.save_file (0.8.0) writes a view's memory in place of its values (safetensors issue #825): the
    # README sends a lab's BGR-to-RGB frames, crops and channel moves to write_step, which must keep them as they read
    import torch

    image = np.random.default_rng(0).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    chw = image.transpose(2, 0, 1)  # (3, H, W), as torchvision holds a frame
    views = {"bgr_to_rgb": image[..., ::-1], "crop": image[1:5, 2:7], "moved": np.moveaxis(chw, 0, -1),
             "fortran": np.asfortranarray(image), "torch_permuted": torch.from_numpy(chw).permute(1, 2, 0)}
    path = write_step(tmp_path / "ep", 0, views, prompt="pick", format=fmt)
    raw = read_step(path)
    for key, view in views.items():
        np.testing.assert_array_equal(raw.arrays[key], np.asarray(view), err_msg=key)


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_step_prompt_is_metadata(tmp_path, fmt):
    path = write_step(tmp_path, 3, arrays(3), prompt="open the drawer", format=fmt)
    raw = read_step(path)
    assert raw.metadata["prompt"] == "open the drawer"
    assert "prompt" not in raw.arrays


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_a_prompt_given_in_step_metadata_is_the_steps_prompt_and_only_text(tmp_path, fmt):
    """metadata={"prompt": ...} is the step's prompt, as prompt= is: numpy's str_ (read from a dataset) is written as
    text and recorded in episode.yaml for the later steps (it was not: a step 1 written without a prompt then had
    none), a number is refused as prompt= refuses it, and so are two different prompts, before anything is
    written."""
    path = write_step(tmp_path / "ep", 0, arrays(0), metadata={"prompt": np.str_("open the drawer")}, format=fmt)
    assert read_step(path).metadata == {"prompt": "open the drawer"}
    assert (tmp_path / "ep" / "episode.yaml").read_text() == "prompt: open the drawer\n"
    with pytest.raises(TypeError, match=r"^prompt must be text \(str\), got 5 \(int\)$"):
        write_step(tmp_path / "ep", 1, arrays(1), metadata={"prompt": 5}, format=fmt)
    with pytest.raises(ValueError, match=r"^two prompts for step 1: prompt='close it' and metadata\['prompt'\]="
                                         r"'open it'; give one$"):
        write_step(tmp_path / "ep", 1, arrays(1), prompt="close it", metadata={"prompt": "open it"}, format=fmt)
    assert sorted(p.name for p in (tmp_path / "ep").iterdir()) == ["episode.yaml", path.name]
    same = write_step(tmp_path / "ep", 1, arrays(1), prompt="open it", metadata={"prompt": "open it"}, format=fmt)
    assert read_step(same).metadata == {"prompt": "open it"}


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_a_prompt_with_a_lone_surrogate_is_refused_before_anything_is_written(tmp_path, fmt):
    """rollout refuses a prompt holding a lone surrogate (text decoded with errors="surrogateescape"); the writer
    recorded it in episode.yaml and the .npz (an episode every rollout then failed), or failed in safetensors with a
    bare UnicodeEncodeError. Refused up front, by every way a prompt is given, and nothing is written."""
    bad = "pick \udcff up"
    message = r"^prompt holds '\\udcff' at position 5, a lone surrogate that is no character"
    for call in (lambda: write_step(tmp_path / "ep", 0, arrays(0), prompt=bad, format=fmt),
                 lambda: write_step(tmp_path / "ep", 0, arrays(0), metadata={"prompt": bad}, format=fmt),
                 lambda: write_episode(tmp_path / "ep", [arrays(0)], prompt=bad, format=fmt),
                 lambda: write_episode(tmp_path / "ep", [arrays(0)], metadata={"prompt": bad}, format=fmt)):
        with pytest.raises(ValueError, match=message):
            call()
        assert not (tmp_path / "ep").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_any_array_name_is_kept_and_a_prompt_from_a_dataset_is_text(tmp_path, fmt):
    """np.savez(**arrays) took an array named 'allow_pickle' for its option (dropped) and one named 'file' for its
    argument (TypeError); a prompt read from a dataset is numpy's str_, which YAML could not write to episode.yaml."""
    named = {"allow_pickle": np.zeros(3, np.float32), "file": np.ones(2, np.float32), "x": np.arange(4)}
    paths = write_episode(tmp_path / "ep", [named], prompt=np.array(["pick the cup"])[0], format=fmt)
    raw = read_step(paths[0])
    assert sorted(raw.arrays) == ["allow_pickle", "file", "x"]
    np.testing.assert_array_equal(raw.arrays["file"], named["file"])
    assert (tmp_path / "ep" / "episode.yaml").read_text() == "prompt: pick the cup\n"
    write_step(tmp_path / "live", 0, named, prompt=np.str_("open it"), format=fmt)
    assert (tmp_path / "live" / "episode.yaml").read_text() == "prompt: open it\n"


def test_episode_metadata_read_with_numpy_or_torch_is_written_as_plain_yaml(tmp_path):
    # YAML's safe dumper raised "cannot represent an object" for a numpy float, after the folder was made.
    import torch

    meta = {"fps": np.float32(15.0), "arm": {"id": np.int64(3), "home": np.array([0.5, -1.0]),
                                             "limits": [np.float64(1.5), torch.tensor(2.0)]}, "tags": ("a", "b"),
            "offset": torch.nn.Parameter(torch.tensor([0.25])), "mask": np.ma.masked_array([1, 2], mask=[0, 1])}
    write_episode(tmp_path / "ep", [arrays(0)], prompt="pick", metadata=meta)
    assert yaml.safe_load((tmp_path / "ep" / "episode.yaml").read_text()) == {
        "fps": 15.0, "arm": {"id": 3, "home": [0.5, -1.0], "limits": [1.5, 2.0]}, "tags": ["a", "b"], "offset": [0.25],
        "mask": [1, None], "prompt": "pick"}  # subclasses too: a model's parameter, a masked array
    with pytest.raises(TypeError, match=r"^metadata: episode.yaml cannot hold .*\(object\); it holds text, numbers"):
        write_episode(tmp_path / "bad", [arrays(0)], metadata={"calibration": object()})
    assert not (tmp_path / "bad").exists()
    # Keys are text at every level, as the README says: a number is not made text, it is refused, naming it.
    with pytest.raises(TypeError, match=r"^metadata\['arm'\]: key 3 \(int\) is not text; .*episode.yaml keys are text"):
        write_episode(tmp_path / "bad", [arrays(0)], metadata={"arm": {3: "wrist"}})
    assert not (tmp_path / "bad").exists()


def test_numpy_string_keys_in_episode_metadata_are_written_as_text(tmp_path):
    """A key read from a dataset is numpy's str_, a str: episode.yaml "cannot hold np.str_('arm') (str_); it holds
    text, ..." refused it as what it is."""
    meta = {np.str_("arm"): {np.str_("id"): 3}, "cameras": [{np.str_("name"): np.str_("wrist")}]}
    write_episode(tmp_path / "ep", [arrays(0)], prompt="pick", metadata=meta)
    text = (tmp_path / "ep" / "episode.yaml").read_text()
    assert yaml.safe_load(text) == {"arm": {"id": 3}, "cameras": [{"name": "wrist"}], "prompt": "pick"}
    assert discover_episodes([tmp_path / "ep"])[0].metadata() == yaml.safe_load(text)  # as rollout reads it


@pytest.mark.parametrize("key, said", [(np.int64(3), r"np.int64\(3\) \(numpy.int64\)"),
                                       (np.bool_(True), r"np.True_ \(numpy.bool\)")])
def test_numpy_number_and_bool_keys_in_episode_metadata_are_refused_naming_the_file_key_and_type(tmp_path, key, said):
    """numpy's str_ is text and is written as text; its int64 and bool_ are not, and are refused as Python's int
    and bool are ({3: ...} and {"3": ...} would read back as one key). The refusal said "key np.True_ (bool)", a
    Python bool's name, and named no file: it names episode.yaml's path, numpy's type and what to give instead."""
    folder = tmp_path / "ep"
    with pytest.raises(TypeError) as raised:
        write_episode(folder, [arrays(0)], prompt="pick", metadata={"cams": [{key: "wrist"}]})
    assert re.fullmatch(rf"metadata\['cams'\]: key {said} is not text; {re.escape(str(folder / 'episode.yaml'))} keys "
                        rf"are text: give str\(key\) \('{key}'\) if it names a field", str(raised.value)), raised.value
    assert not folder.exists()  # refused before anything is written


def test_what_a_step_file_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    folder = tmp_path / "ep"
    with pytest.raises(TypeError, match=r"^prompt must be text \(str\), got 5 \(int\)$"):  # rollout refused it
        write_episode(folder, [arrays(0)], prompt=5)
    with pytest.raises(ValueError, match=r"^format must be one of \('safetensors', 'npz'\), got 'pt'$"):
        write_step(folder, 0, arrays(0), prompt="p", format="pt")
    with pytest.raises(ValueError, match=r"^'prompt': the name of an array and of a metadata key"):
        write_step(folder, 0, {"prompt": np.zeros(2)}, prompt="p", format="npz")
    for format in ("npz", "safetensors"):  # npz: was pickled, then unreadable; safetensors: 'Unknown dtype'
        with pytest.raises(TypeError, match=r"^array 'o' has dtype object: a step file holds bool, integer or "):
            write_step(folder, 0, {"o": np.array([{}], dtype=object)}, format=format)
    with pytest.raises(TypeError, match=r"^array 'caption' has dtype <U4"):
        write_step(folder, 0, {"caption": np.array(["pick"])})
    # numpy's and torch's own errors, named by the array: a ragged list, a dtype numpy has no type for
    import torch

    for value in ([[0.0, 1.0], [2.0]], torch.zeros(2, dtype=torch.float8_e4m3fn)):
        with pytest.raises(TypeError, match=r"^array 'joints': cannot be a step file's array: "):
            write_step(folder, 0, {"joints": value})
    # the prompt None was written as the text 'None' and ran as the prompt; a tensor as 'tensor(1.5000)'
    with pytest.raises(TypeError, match=r"^prompt must be text \(str\), got None"):
        write_step(folder, 0, arrays(0), metadata={"prompt": None})
    with pytest.raises(TypeError, match=r"^metadata 'scale': a step file's metadata is text \(or a number, written as "
                                        r"text\), got None \(NoneType\)"):
        write_step(folder, 0, arrays(0), metadata={"scale": None})
    with pytest.raises(TypeError, match=r"^metadata 'gain': .*got .*\(Tensor\)"):
        write_step(folder, 0, arrays(0), metadata={"gain": __import__("torch").ones(2)})
    # a key made text: None read back as 'None', and {3: ...} with {"3": ...} one key (episode.yaml refuses both)
    with pytest.raises(TypeError, match=rf"^{re.escape(str(folder))} step 2: metadata key None \(NoneType\) is not "
                                        r"text; a step file's metadata keys are text: give the field a str name "
                                        r"\('None' if that is what it means\)$"):
        write_step(folder, 2, arrays(0), metadata={None: "x"})
    for key, said in ((3, r"3 \(int\)"), (np.int64(3), r"np.int64\(3\) \(numpy.int64\)")):
        with pytest.raises(TypeError, match=rf"step 0: metadata key {said} is not text; .*\('3' if that is"):
            write_step(folder, 0, arrays(0), metadata={key: "a", "3": "b"})
    write_step(folder, 0, arrays(0), metadata={np.str_("camera"): "wrist"})  # numpy's str_ is text
    for key in (3, None):  # an array's name made text: {3: ..} with {"3": ..} was one array
        with pytest.raises(TypeError, match=rf"^array name {key} \({type(key).__name__}\) is not text: .*"
                                            rf"give the array a str name \('{key}' if that is what it means\)$"):
            write_step(folder, 1, {key: np.zeros(2), "3": np.ones(2)})
    assert not (folder / "step_000001.safetensors").exists()
    (folder / "step_000000.safetensors").unlink()
    # episode.yaml: written, then refused by rollout ('expected the prompt as text'; 'found unhashable key')
    with pytest.raises(TypeError, match=r"^prompt must be text \(str\), got 5 \(int\)$"):
        write_episode(folder, [arrays(0)], metadata={"prompt": 5})
    with pytest.raises(TypeError, match=r"^metadata 'prompt': prompt must be text \(str\), got None$"):
        write_episode(folder, [arrays(0)], metadata={"prompt": None})
    with pytest.raises(TypeError, match=r"^metadata\['calib'\]: key \(0, 1\) \(tuple\) is not text"):
        write_episode(folder, [arrays(0)], metadata={"calib": {(0, 1): 0.5}})
    assert not folder.exists() or not any(folder.iterdir())


def test_a_misused_writer_call_is_a_typed_error_and_writes_nothing(tmp_path, monkeypatch):
    """Arguments wrong in their kind: no AttributeError from deep inside ('NoneType' object has no attribute
    'items'), no episode.yaml left behind by a write_episode that fails at its first step, and no steps written into
    the current folder for an empty folder argument (an unset environment variable)."""
    folder = tmp_path / "ep"
    for value in (None, [arrays(0)]):
        with pytest.raises(TypeError, match=r"^a step's arrays are a mapping \(dict\) of name -> array, got "):
            write_step(folder, 0, value, prompt="p")
    with pytest.raises(TypeError, match=r"^steps is a sequence of steps, .* got a dict \(for one step, pass "
                                        r"\[arrays\]\)$"):
        write_episode(folder, arrays(0), prompt="p")  # one step's arrays: each key was taken for a step
    with pytest.raises(TypeError, match=r"^steps\[1\]: a step's arrays are a mapping \(dict\) of name -> array, "
                                        r"got None \(NoneType\)$"):
        write_episode(folder, [arrays(0), None], prompt="p")
    for first_step in (-1, 0.5, "1"):
        with pytest.raises(ValueError, match=r"^first_step must be a non-negative integer, got "):
            write_episode(folder, [arrays(0)], prompt="p", first_step=first_step)
    assert not folder.exists()
    monkeypatch.chdir(tmp_path)
    for call in (lambda: write_step("", 0, arrays(0), prompt="p"), lambda: write_episode("", [arrays(0)]),
                 lambda: end_episode("")):
        with pytest.raises(ValueError, match=r"^the episode folder is empty \(''\)"):
            call()
    assert not list(tmp_path.iterdir())


def test_step_metadata_numbers_are_written_as_text_and_a_folder_is_a_folder(tmp_path, monkeypatch):
    path = write_step(tmp_path / "ep", 0, arrays(0), prompt="p", metadata={"fps": np.float32(15.0), "arm": 3})
    assert read_step(path).metadata == {"fps": "15.0", "arm": "3", "prompt": "p"}
    (tmp_path / "afile").write_text("x")
    # it read mkdir's "[Errno 17] File exists", of a path the recorder meant as a folder
    for call in (lambda: write_step(tmp_path / "afile", 0, arrays(0)), lambda: end_episode(tmp_path / "afile"),
                 lambda: write_episode(tmp_path / "afile", [arrays(0)])):
        with pytest.raises(NotADirectoryError, match=f"^{tmp_path / 'afile'}: an episode folder, but it is a file$"):
            call()
    # a mistyped folder was made, holding only END: an episode that fails for having no step
    with pytest.raises(FileNotFoundError, match="no such episode folder"):
        end_episode(tmp_path / "ep_typo")
    assert not (tmp_path / "ep_typo").exists()
    # ~ is the home folder, as on the command line: a recorder and `ardiff rollout --follow '~/ep'` agree
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert write_step("~/ep", 0, arrays(0), prompt="p") == tmp_path / "home" / "ep" / "step_000000.safetensors"
    assert end_episode("~/ep") == tmp_path / "home" / "ep" / "END"
    # ~user of no user is kept as written, as a shell keeps it: a folder of that name in the working folder
    monkeypatch.chdir(tmp_path)
    assert str(write_step("~nosuchuser-ardiff/ep", 0, arrays(0))) == "~nosuchuser-ardiff/ep/step_000000.safetensors"
    assert (tmp_path / "~nosuchuser-ardiff" / "ep" / "step_000000.safetensors").is_file()
    # "./~" is the folder named ~ in the working folder, as `ardiff rollout ./~/ep` reads it (it was the home folder)
    assert str(write_step("./~/ep", 0, arrays(0))) == "~/ep/step_000000.safetensors"
    assert str(end_episode("./~/ep")) == "~/ep/END" and (tmp_path / "~" / "ep" / "END").is_file()
    # and so for a whole episode: its steps and END went to the home folder's ep, its episode.yaml to ./~/ep
    assert [str(path) for path in write_episode("./~/whole", [arrays(0)], prompt="p")] == [
        "~/whole/step_000000.safetensors"]
    assert sorted(os.listdir(tmp_path / "~" / "whole")) == ["END", "episode.yaml", "step_000000.safetensors"]
    assert not (tmp_path / "home" / "whole").exists()


def test_write_step_accepts_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    path = write_step(tmp_path, 0, {"x": torch.ones(2, 3, dtype=torch.bfloat16)})
    raw = read_step(path)
    assert raw.arrays["x"].dtype == np.float32 and raw.arrays["x"].shape == (2, 3)


def test_steps_are_ordered_by_number_not_name(tmp_path):
    for name in ("frame_10.npz", "frame_9.npz", "frame_2.npz", ".hidden_1.npz", "x_3.npz.tmp", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert [s.step for s in scan_steps(tmp_path)] == [2, 9, 10]
    assert step_number(tmp_path / "run3_step_000012.safetensors") == 12


def test_step_file_without_number_and_duplicates_are_errors(tmp_path):
    (tmp_path / "first.npz").write_bytes(b"x")
    with pytest.raises(ObservationError, match="first.npz: step file name has no step number"):
        scan_steps(tmp_path)
    (tmp_path / "first.npz").unlink()
    (tmp_path / "step_1.npz").write_bytes(b"x")
    (tmp_path / "step_001.safetensors").write_bytes(b"x")
    with pytest.raises(ObservationError, match="two files for step 1"):
        scan_steps(tmp_path)


def test_corrupt_files_name_their_path(tmp_path):
    bad = tmp_path / "step_0.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ObservationError, match="step_0.safetensors: cannot read safetensors"):
        read_step(bad)
    bad_npz = tmp_path / "step_1.npz"
    bad_npz.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ObservationError, match="step_1.npz"):
        read_step(bad_npz)
    pickled = tmp_path / "step_2.npz"
    np.savez(pickled, obj=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ObservationError, match="without pickle"):
        read_step(pickled)


def test_discover_expands_dataset_folders_and_dedups_names(tmp_path):
    write_episode(tmp_path / "set" / "a", [arrays(0)])
    write_episode(tmp_path / "set" / "b", [arrays(0)])
    write_episode(tmp_path / "other" / "a", [arrays(0)])
    episodes = discover_episodes([tmp_path / "set", tmp_path / "other" / "a"])
    assert [e.name for e in episodes] == ["a", "b", "a-2"]
    (tmp_path / "empty").mkdir()
    assert [e.name for e in discover_episodes([tmp_path / "empty"])] == ["empty"]  # a live episode, not yet written
    with pytest.raises(ConfigError, match="not found") as info:
        discover_episodes([tmp_path / "missing"])
    assert info.value.hint.endswith("create its folder first (mkdir -p) and use --follow")
    with pytest.raises(ConfigError, match="not found") as info:  # given --follow already: not suggested again
        discover_episodes([tmp_path / "missing"], follow=True)
    assert info.value.hint.endswith("create its folder first (mkdir -p)")
    with pytest.raises(ConfigError, match="not a file"):
        discover_episodes([tmp_path / "set" / "a" / "END"])


def test_a_link_to_the_folder_of_episodes_or_one_above_it_is_no_episode(tmp_path):
    """Each ran as an episode of no step files (the folder it leads to), which failed the run (exit 4), with a
    warning that the one was given twice."""
    write_episode(tmp_path / "set" / "a", [arrays(0)])
    (tmp_path / "set" / "latest").symlink_to(".")
    (tmp_path / "set" / "up").symlink_to("..")
    warnings: list[str] = []
    assert [e.name for e in discover_episodes([tmp_path / "set"], warn=warnings.append)] == ["a"]
    assert warnings == []


def test_a_folder_reached_three_times_is_one_warning_per_path(tmp_path):
    """`data/ data/pick_cube` where data/cam links to pick_cube reaches pick_cube three times: the same line,
    `data/pick_cube is episode 'pick_cube' again (...)`, was written twice."""
    write_episode(tmp_path / "data" / "pick_cube", [arrays(0)])
    (tmp_path / "data" / "cam").symlink_to("pick_cube")
    warnings: list[str] = []
    episodes = discover_episodes([tmp_path / "data", tmp_path / "data" / "pick_cube"], warn=warnings.append)
    assert [e.name for e in episodes] == ["pick_cube"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{tmp_path / 'data' / 'pick_cube'} is episode 'pick_cube' "
                                                         "again"), warnings


def test_a_link_to_nothing_in_a_folder_of_episodes_is_named_without_follow(tmp_path):
    """`cam -> ../rec/arm_a` made before its recording, or a loop of links, was passed over without a word: the run
    ended 0 without that episode. Without --follow each is named in a warning; with it, it is looked at again at each
    poll (it joins once its recording is there), and named only if it never does."""
    write_episode(tmp_path / "set" / "a", [arrays(0)])
    (tmp_path / "set" / "cam").symlink_to("../rec/arm_a")
    (tmp_path / "set" / "loop").symlink_to("loop")
    (tmp_path / "set" / ".hidden").symlink_to("nowhere")  # hidden: never an episode, never named
    warnings: list[str] = []
    assert [e.name for e in discover_episodes([tmp_path / "set"], warn=warnings.append)] == ["a"]
    cam, loop = tmp_path / "set" / "cam", tmp_path / "set" / "loop"
    assert warnings == [
        f"{cam} does not run: it is a link to ../rec/arm_a, which does not exist (point it at the episode's folder and "
        "give it as EPISODE, or use --follow to run it once its recording is there)",
        f"{loop} does not run: it is a link to loop, which leads back to itself (a loop of links) (point it at the "
        "episode's folder and give it as EPISODE, or use --follow to run it once its recording is there)"], warnings
    warnings.clear()
    assert [e.name for e in discover_episodes([tmp_path / "set"], warn=warnings.append, follow=True)] == ["a"]
    assert warnings == []
    write_episode(tmp_path / "rec" / "arm_a", [arrays(0)])  # its recording made: it is an episode, nothing to say
    assert [e.name for e in discover_episodes([tmp_path / "set"], warn=warnings.append)] == ["a", "arm_a"]
    assert warnings == [warnings[0]] and warnings[0].startswith(f"{loop} does not run"), warnings


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "out.bin"
    atomic_write_bytes(target, b"first")
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["out.bin"]


def test_jsonl_appender_repairs_a_partial_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    with JsonlAppender(path) as log:
        log.append({"step": 0})
        log.append({"step": 1})
    with open(path, "ab") as f:
        f.write(b'{"step": 2, "sta')  # what a power loss mid-write could leave
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    with JsonlAppender(path) as log:
        log.append({"step": 2})
    assert path.read_bytes().count(b"\n") == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


@pytest.mark.parametrize("content", [b"", b"\n", b"abc", b"a\n", b"a\nbc", b"line\n" * 7 + b"x" * 9,
                                     b"line\n" * 7 + b"x" * 3, b"x" * 20, b"ab\n" + b"y" * 13, b"\n" + b"z" * 4])
@pytest.mark.parametrize("chunk", [1, 2, 4, 1 << 16])
def test_a_partial_last_line_is_cut_reading_back_from_the_end(tmp_path, content, chunk):
    # The whole file was read to find its last newline: 220 MiB for a results.jsonl of 100,000 lines.
    path = tmp_path / "results.jsonl"
    path.write_bytes(content)
    truncate_partial_line(path, chunk=chunk)
    assert path.read_bytes() == content[:content.rfind(b"\n") + 1]


def test_done_steps_need_a_line_and_the_file(tmp_path):
    run = RunFolder(tmp_path)
    path = run.write_step_outputs("ep", 0, {"actions": np.zeros((2, 8), np.float32), "note": "ignored"}, {})
    run.append_result({"episode": "ep", "step": 0, "chunk": 3, "status": "ok", "output": run.relative(path)})
    run.append_result({"episode": "ep", "step": 1, "status": "ok", "output": "episodes/ep/step_000001.safetensors"})
    run.append_result({"episode": "ep", "step": 2, "status": "failed", "error": "bad"})
    run.close()
    assert run.resume_state()[0] == {"ep": {0: 3}}  # each done step with its chunk when it ran


def test_start_refuses_a_folder_with_a_run(tmp_path):
    """With the resume of the run there to paste, its --pipeline given again: it said "continue it with --resume, or
    choose another --out", shorter than the CLI's own check before the lock."""
    RunFolder(tmp_path).start({"config": "x", "pipeline_option": "lab:Model"})
    with pytest.raises(ConfigError, match="already holds a run") as info:
        RunFolder(tmp_path).start({"config": "x"})
    assert info.value.hint == (f"continue it with: ardiff rollout --resume --out {tmp_path} --pipeline lab:Model; or "
                               "choose another --out")
    assert RunFolder(tmp_path).read_info()["config"] == "x"


def test_percentiles_nearest_rank():
    stats = percentiles([float(i) for i in range(1, 101)])
    assert (stats["p50"], stats["p90"], stats["p99"], stats["max"]) == (50.0, 90.0, 99.0, 100.0)
    assert percentiles([])["p50"] is None


def _png_chunks(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(tag + body)
        yield tag, body
        pos += 12 + length


def test_the_summary_of_many_episodes_reads_the_completed_ones_once(tmp_path):
    """summary.json counted the completed episodes by building a set of them again for each episode: 10,000
    episodes took 1.3 s at the end of the run. Counted here in passes over the list, never timed."""
    from ardiff_cli.io.run import build_summary

    class Listed(list):  # counts the passes made over it
        passes = 0

        def __iter__(self):
            Listed.passes += 1
            return super().__iter__()

    names = [f"ep_{i}" for i in range(300)]
    summary = build_summary([], episodes=names, failed={"ep_7": "bad"}, info={}, plan=None,
                            this_run={"completed_episodes": Listed(n for n in names if n != "ep_7")}, wall_s=1.0,
                            running_s=0.5, status="partial", exit_code=4, root=tmp_path)
    assert summary["episodes"]["completed"] == 299 and summary["episodes"]["failed"] == 1
    assert Listed.passes == 1, f"{Listed.passes} passes over the completed episodes"  # was one per episode


@pytest.mark.parametrize("scan_step", [None, -1])  # -1: lines of versions before null
def test_a_failed_scan_line_reads_and_counts_until_a_later_ok_line_of_its_episode(tmp_path, scan_step):
    run = RunFolder(tmp_path)
    (tmp_path / "episodes" / "ep").mkdir(parents=True)
    for step in (0, 1):
        save_file({"actions": np.zeros(2, np.float32)}, str(tmp_path / f"episodes/ep/step_{step:06d}.safetensors"))
    lines = [{"episode": "ep", "step": 0, "chunk": 0, "status": "ok", "output": "episodes/ep/step_000000.safetensors"},
             {"episode": "ep", "step": scan_step, "chunk": scan_step, "status": "failed", "phase": "scan"},
             {"episode": "ep", "step": 1, "chunk": 1, "status": "ok", "output": "episodes/ep/step_000001.safetensors"}]
    for line in lines:
        run.append_result(line)
    run.close()
    assert run.resume_state()[0] == {"ep": {0: 0, 1: 1}}

    def failed_steps(records):
        return build_summary(records, episodes=["ep"], failed={}, info={}, plan=None, this_run={}, wall_s=1.0,
                             running_s=0.5, status="ok", exit_code=0, root=tmp_path)["steps"]["failed"]

    assert failed_steps(lines[:2]) == 1 and failed_steps(lines) == 0


def test_png_decodes_to_the_same_pixels():
    image = np.random.default_rng(0).integers(0, 255, (5, 7, 3), dtype=np.uint8)
    chunks = dict(_png_chunks(encode_png(image)))
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (width, height, depth, color) == (7, 5, 8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(5, 1 + 7 * 3)
    assert (rows[:, 0] == 0).all()
    np.testing.assert_array_equal(rows[:, 1:].reshape(5, 7, 3), image)


def test_preview_strip_places_observed_over_predicted():
    observed = [np.full((4, 4, 3), 100, np.uint8)] * 3
    predicted = [np.full((2, 2, 3), 200, np.uint8), None, np.full((4, 4, 3), 50, np.uint8)]
    strip = preview_strip(observed, predicted, gap=1)
    assert strip.shape == (9, 14, 3)
    assert (strip[:4, :4] == 100).all() and (strip[5:, :4] == 200).all()  # predicted resized to 4x4
    assert (strip[5:, 5:9] == 32).all()  # missing prediction stays background
    assert (strip[5:, 10:] == 50).all()


@pytest.mark.parametrize("shape", [(1, 1000, 3), (1000, 1, 3), (2000, 3000, 3)])
def test_preview_tiles_stay_small_whatever_the_frame_shape(shape):
    """A 1x1000 camera frame, scaled up to 96 pixels high, made each column 96,000 pixels wide (three steps: a
    288,000-pixel-wide PNG few viewers open); a large frame was drawn at full size in every column. A tile is now at
    most 256 pixels a side, in the frame's proportions, and at least one pixel."""
    frame = np.full(shape, 7, np.uint8)
    strip = preview_strip([frame] * 3, [None] * 3, min_height=96)
    tile_h, tile_w = (strip.shape[0] - 2) // 2, (strip.shape[1] - 4) // 3
    assert max(tile_h, tile_w) == 256 and min(tile_h, tile_w) >= 1, strip.shape
    assert (strip[:tile_h, :tile_w] == 7).all()
    assert chunks_ok(encode_png(strip))


def chunks_ok(data: bytes) -> bool:
    """A whole PNG: each chunk's CRC right, IHDR first, IEND last, the pixels as long as IHDR says."""
    chunks = list(_png_chunks(data))
    width, height, _, color = struct.unpack(">IIBB", dict(chunks)[b"IHDR"][:10])
    pixels = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    channels = 3 if color == 2 else 1
    return (chunks[0][0], chunks[-1][0]) == (b"IHDR", b"IEND") and len(pixels) == height * (1 + width * channels)


def test_evenly_spaced_keeps_the_first_and_last_and_at_most_the_limit():
    assert evenly_spaced(3, 64) == [0, 1, 2] and evenly_spaced(0, 64) == []
    for count in (65, 70, 1000, 10_000):
        picked = evenly_spaced(count, 64)
        assert len(picked) == 64 and picked[0] == 0 and picked[-1] == count - 1
        assert picked == sorted(set(picked))
    assert evenly_spaced(5, 1) == [4]


def test_end_marker(tmp_path):
    (tmp_path / "ep").mkdir()
    end_episode(tmp_path / "ep")
    assert (tmp_path / "ep" / "END").read_bytes() == b""


def test_the_same_arrays_and_metadata_always_give_the_same_bytes(tmp_path):
    """Outputs are compared by checksum (a resumed run against an uninterrupted one, rsync, dedup): safetensors
    writes its metadata map in hash order, so ardiff sorts it."""
    from safetensors import safe_open

    from ardiff_cli.io.writer import encode_arrays

    metadata = {"episode": "arm_a", "step": "3", "request_id": "arm_a/000003", "prompt": "pick up the cube é"}
    blobs = {encode_arrays(arrays(3), metadata=metadata) for _ in range(30)}
    assert len(blobs) == 1
    path = tmp_path / "step.safetensors"
    path.write_bytes(blobs.pop())
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == metadata
        np.testing.assert_array_equal(f.get_tensor("joints"), arrays(3)["joints"])


def test_metadata_sorted_in_a_written_file_keeps_its_tensors(tmp_path):
    """``sort_metadata_in_file`` (checkpoints): the header rewritten in place when its length stays, the whole file
    when not (here a header padded wider than safetensors pads it), and the same bytes as encoding at once."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from ardiff_cli.io.writer import encode_arrays, sort_metadata_in_file

    metadata = {"pipeline": "causal_world", "format": "pt", "config": '{"dim": 64, "name": "é"}', "b": "1"}
    expected = encode_arrays(arrays(5), metadata=metadata)
    in_place, padded = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(arrays(5), str(in_place), metadata=metadata)
    blob = in_place.read_bytes()
    size = struct.unpack("<Q", blob[:8])[0]
    padded.write_bytes(struct.pack("<Q", size + 64) + blob[8:8 + size] + b" " * 64 + blob[8 + size:])
    for path in (in_place, padded):
        sort_metadata_in_file(path)
        assert path.read_bytes() == expected, path.name
        with safe_open(str(path), framework="np") as f:
            assert f.metadata() == metadata
            np.testing.assert_array_equal(f.get_tensor("image"), arrays(5)["image"])


def test_read_step_takes_a_path_given_as_a_string(tmp_path):
    (path,) = write_episode(tmp_path / "ep", [arrays(0)], prompt="pick")
    raw = read_step(str(path))
    np.testing.assert_array_equal(raw.arrays["image"], arrays(0)["image"])
    assert raw.sha256 == read_step(path).sha256


def test_read_step_of_a_file_of_another_type_names_the_suffixes_it_reads(tmp_path):
    """read_step (the public reader) of a file in a format ardiff never reads, a torch.save file here: the file and the
    suffixes it does read are named, nothing is unpickled."""
    path = tmp_path / "step_000000.pt"
    path.write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ObservationError, match=rf"^{re.escape(str(path))}: unsupported step file type '.pt'; use "
                                               r"\.safetensors or \.npz$"):
        read_step(path)


@pytest.mark.parametrize("format", ["safetensors", "npz"])
def test_step_sha256_is_the_digest_read_step_records_and_names_a_file_it_cannot_read(tmp_path, format):
    # What --resume compares a kept session's done step files by, without parsing them: it must agree with the
    # input_sha256 that read_step gave when they ran, and fail on a missing file as read_step does.
    (path,) = write_episode(tmp_path / "ep", [arrays(0)], prompt="pick", format=format)
    assert step_sha256(path) == read_step(path).sha256
    path.unlink()
    with pytest.raises(ObservationError) as hashing:
        step_sha256(path)
    with pytest.raises(ObservationError) as reading:
        read_step(path)
    assert f"{path}: cannot read the step file" in str(hashing.value)
    assert (str(hashing.value), hashing.value.hint) == (str(reading.value), reading.value.hint)
    path.write_bytes(b"")  # a write cut short: empty, as read_step says, not a digest that "changed"
    with pytest.raises(ObservationError) as hashing:
        step_sha256(path)
    with pytest.raises(ObservationError) as reading:
        read_step(path)
    assert str(hashing.value) == f"{path}: the file is empty (0 bytes)"
    assert (str(hashing.value), hashing.value.hint) == (str(reading.value), reading.value.hint)


@pytest.mark.parametrize("line", [
    {"episode": "ep", "step": 1, "status": "ok", "output": "x", "input_sha256": "z" * 64},  # 64 chars, not hex
    {"episode": "ep", "step": 1, "status": "ok", "output": "x", "input_sha256": "AB" * 32},  # hashlib is lowercase
])
def test_a_results_line_whose_digest_is_64_chars_but_not_lowercase_hex_is_named(tmp_path, line):
    run = RunFolder(tmp_path)
    run.append_result({"episode": "ep", "step": 0, "status": "ok", "output": "episodes/ep/step_000000.safetensors"})
    run.append_result(line)
    run.close()
    with pytest.raises(ConfigError, match="line 2: expected 'input_sha256' to be a SHA-256 hex digest"):
        run.resume_state()


def test_a_failed_step_that_resume_retries_to_ok_is_no_longer_counted_failed(tmp_path):
    """An episode fails at step 2 (forward); --resume runs step 2 again, ok: the failure is resolved."""
    from ardiff_cli.io.run import build_summary

    lines = [{"episode": "ep", "step": 0, "status": "ok", "output": "episodes/ep/step_000000.safetensors"},
             {"episode": "ep", "step": 1, "status": "ok", "output": "episodes/ep/step_000001.safetensors"},
             {"episode": "ep", "step": 2, "status": "failed", "phase": "forward"},
             {"episode": "ep", "step": 2, "status": "ok", "output": "episodes/ep/step_000002.safetensors"}]

    def steps(records):
        return build_summary(records, episodes=["ep"], failed={}, info={}, plan=None, this_run={}, wall_s=1.0,
                             running_s=0.5, status="ok", exit_code=0, root=tmp_path)["steps"]

    assert steps(lines[:3])["failed"] == 1
    assert steps(lines) == {**steps(lines), "ok": 3, "failed": 0}


def test_a_results_line_whose_step_is_a_boolean_is_named(tmp_path):
    """JSON true is no step number (Python would take it for step 1)."""
    run = RunFolder(tmp_path)
    run.append_result({"episode": "ep", "step": 0, "status": "ok", "output": "episodes/ep/step_000000.safetensors"})
    run.append_result({"episode": "ep", "step": True, "status": "ok", "output": "episodes/ep/step_000001.safetensors"})
    run.close()
    with pytest.raises(ConfigError, match="line 2: expected a line with an integer 'step'"):
        run.resume_state()


def test_summary_episode_counts_add_up(tmp_path):
    """total = completed + failed + incomplete: a failed episode is not also incomplete."""
    from ardiff_cli.io.run import build_summary

    summary = build_summary([], episodes=["a", "b", "c"], failed={"c": "bad file"}, info={}, plan=None,
                            this_run={"completed_episodes": ["a"]}, wall_s=1.0, running_s=0.5, status="failed",
                            exit_code=1, root=tmp_path)["episodes"]
    assert (summary["total"], summary["completed"], summary["failed"], summary["incomplete"]) == (3, 1, 1, 1)


def test_new_episode_folders_returns_each_started_folder_once(tmp_path):
    """``settled`` holds what was returned (and what can never be an episode): a later poll returns only folders
    started since, in name order, and never one already returned."""
    from ardiff_cli.io.episode import new_episode_folders

    robots = tmp_path / "robots"
    (robots / "ep_b").mkdir(parents=True)
    (robots / "ep_a").mkdir()
    (robots / "notes.txt").write_text("not an episode")
    settled: set[str] = set()
    assert new_episode_folders(robots, settled) == []  # both still empty
    write_episode(robots / "ep_b", [arrays(0)], prompt="p", end=False)
    assert new_episode_folders(robots, settled) == [robots / "ep_b"]
    assert new_episode_folders(robots, settled) == []
    (robots / "ep_a" / "END").write_text("")
    assert new_episode_folders(robots, settled) == [robots / "ep_a"]
    assert settled == {"ep_a", "ep_b", "notes.txt"}


def test_a_read_steps_signature_matches_the_file_until_it_is_written_again(tmp_path):
    """load_step records the file's signature as read: file_signature equals it while nobody wrote the file, and
    differs once it was written again (what the end-of-episode check of rewritten step files hashes only then)."""
    import os

    from ardiff_cli.io import write_step
    from ardiff_cli.io.step_file import file_signature, load_step

    path = write_step(tmp_path / "ep", 0, arrays(0), prompt="p")
    raw = load_step(path)
    assert raw.signature is not None and raw.signature == file_signature(path)
    assert raw.signature[0] == path.stat().st_size
    os.utime(path, ns=(1, 1))  # touched (cp -p sets the mtime back): ctime moves, so it is looked at again
    assert file_signature(path) != raw.signature
    assert file_signature(tmp_path / "ep" / "gone.safetensors") is None


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_a_file_longer_than_its_own_structure_says_does_not_look_whole(tmp_path, fmt):
    """looks_whole: exactly as many bytes as the structure says. A byte more (a second write over a shorter first,
    an append) is not a whole step file any more than a byte less."""
    from ardiff_cli.io.step_file import looks_whole
    from ardiff_cli.io.writer import encode_arrays

    blob = encode_arrays(arrays(0), format=fmt)
    path = tmp_path / f"step_000000.{fmt}"
    path.write_bytes(blob)
    assert looks_whole(path, len(blob))
    path.write_bytes(blob + b"\0")
    assert not looks_whole(path, len(blob) + 1)
    path.write_bytes(blob[:-1])
    assert not looks_whole(path, len(blob) - 1)


def test_safetensors_header_refuses_bytes_cut_inside_the_header_even_where_the_json_still_parses(tmp_path):
    """The header's length counts the padding spaces after its JSON: bytes cut inside that padding still parse as
    JSON, but they are cut short, and safetensors_header says so."""
    from ardiff_cli.io.step_file import safetensors_header
    from ardiff_cli.io.writer import encode_arrays

    blob = encode_arrays(arrays(0), metadata={"prompt": "p"})
    length = int.from_bytes(blob[:8], "little")
    assert blob[8 + length - 1:8 + length] == b" "  # padded to 8 bytes (true of this header)
    assert safetensors_header(blob[:8 + length])[0] == length
    with pytest.raises(ValueError):
        safetensors_header(blob[:8 + length - 1])


@pytest.mark.parametrize(("content", "what"), [
    (b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }" + b" " * 50 + b"\n"
     + bytes(28), "a .npy array file"),
    (b"\x89PNG\r\n\x1a\n" + bytes(64), "a PNG image"),
    (b"\x80\x04\x95" + bytes(64), "a pickle"),
], ids=["npy", "png", "pickle"])
def test_an_npz_step_file_of_another_format_is_named_not_parsed(tmp_path, content, what):
    """An .npz is a zip archive: anything else under the suffix is named by its format, never handed to np.load."""
    from ardiff_cli.io.step_file import load_step
    from ardiff_cli.runtime.errors import ObservationError

    path = tmp_path / "step_000000.npz"
    path.write_bytes(content)
    with pytest.raises(ObservationError, match=f"cannot read .npz file: it is {what}"):
        load_step(path)


def test_an_npz_text_array_is_an_array_only_a_0d_one_is_metadata(tmp_path):
    """0-d string arrays of an .npz are metadata (the prompt); a 1-d string array is an array like any other (the
    schema's validation then names it), never folded into a metadata string."""
    from ardiff_cli.io.step_file import load_step

    path = tmp_path / "step_000000.npz"
    np.savez(path, joints=np.zeros(7, np.float32), prompt=np.array("pick it up"), labels=np.array(["a", "b"]))
    raw = load_step(path)
    assert raw.metadata == {"prompt": "pick it up"}
    assert sorted(raw.arrays) == ["joints", "labels"] and raw.arrays["labels"].tolist() == ["a", "b"]


def test_an_episode_yaml_that_arrives_after_the_first_look_is_read(tmp_path):
    """EpisodeSource.metadata: {} while episode.yaml is absent, read once it exists (a recorder writes it late)."""
    from ardiff_cli.io.episode import EpisodeSource

    folder = tmp_path / "ep"
    folder.mkdir()
    source = EpisodeSource(name="ep", path=folder)
    assert source.metadata() == {}
    (folder / "episode.yaml").write_text("prompt: pick up the red cube\n")
    assert source.metadata() == {"prompt": "pick up the red cube"}
    (folder / "episode.yaml").write_text("prompt: another\n")
    assert source.metadata() == {"prompt": "pick up the red cube"}  # read once, then kept


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_non_contiguous_arrays_are_written_with_their_values(tmp_path, fmt):
    """A transposed or flipped view (a camera frame mirrored, joints read column-wise) is written as its values, not
    as the buffer underneath it."""
    from ardiff_cli.io import write_step
    from ardiff_cli.io.step_file import load_step

    joints = np.arange(12, dtype=np.float32).reshape(3, 4).T
    camera = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)[:, ::-1]
    assert not joints.flags.c_contiguous and not camera.flags.c_contiguous
    raw = load_step(write_step(tmp_path / "ep", 0, {"joints": joints, "camera": camera}, format=fmt))
    np.testing.assert_array_equal(raw.arrays["joints"], joints)
    np.testing.assert_array_equal(raw.arrays["camera"], camera)


def test_a_step_files_tensor_data_stays_8_byte_aligned_whatever_its_metadata(tmp_path):
    """Sorting the metadata rewrites the header: it is padded again so that the tensors' data starts at a multiple
    of 8 bytes, as safetensors writes it (readers that map the file rely on it)."""
    from ardiff_cli.io.step_file import load_step, safetensors_header
    from ardiff_cli.io.writer import encode_arrays

    for n in range(1, 17):  # every header length modulo 8
        blob = encode_arrays(arrays(0), metadata={"prompt": "x" * n, "b": "1", "a": "2"})
        length, header = safetensors_header(blob)
        assert length % 8 == 0, (n, length)
        assert list(header["__metadata__"]) == ["a", "b", "prompt"]
        path = tmp_path / f"step_{n:06d}.safetensors"
        path.write_bytes(blob)
        np.testing.assert_array_equal(load_step(path).arrays["joints"], arrays(0)["joints"])


def _write_in_a_child(target, size: int, *, die: bool) -> subprocess.CompletedProcess:
    """``atomic_write_bytes`` in a child whose files may not grow past 4 KiB (RLIMIT_FSIZE). SIGXFSZ at its default
    action: the kernel kills the child inside the write, as kill -9 or a power loss would. Ignored (Python's own
    setting): the write fails with EFBIG, as on a full disk."""
    code = ("import signal, sys\nfrom ardiff_cli.io.atomic import atomic_write_bytes\n"
            f"signal.signal(signal.SIGXFSZ, signal.{'SIG_DFL' if die else 'SIG_IGN'})\n"
            f"atomic_write_bytes(sys.argv[1], b'x' * {size})\n")
    return subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))


def test_a_write_that_fails_midway_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    target = atomic_write_bytes(tmp_path / "out.bin", b"old")
    proc = _write_in_a_child(target, 100_000, die=False)
    assert proc.returncode == 1 and "File too large" in proc.stderr, proc.stderr
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary file left behind


def test_a_write_killed_midway_leaves_a_temporary_that_remove_temporaries_finds(tmp_path):
    target = atomic_write_bytes(tmp_path / "out.bin", b"old")
    proc = _write_in_a_child(target, 100_000, die=True)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr
    assert target.read_bytes() == b"old"  # the target is never half written
    left = sorted(set(os.listdir(tmp_path)) - {"out.bin"})
    assert len(left) == 1 and temporary_pattern(re.escape("out.bin")).fullmatch(left[0]), left
    assert remove_temporaries(tmp_path, re.escape("out.bin")) == []  # just written: a live writer's, for all it knows
    assert remove_temporaries(tmp_path, re.escape("out.bin"), older_than_s=0) == [tmp_path / left[0]]
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_blank_line_left_by_deleting_a_damaged_line_in_an_editor_is_skipped(tmp_path):
    # read_jsonl's hint says to delete a damaged line: an editor can leave it empty (or blank) instead.
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"step": 0}\n\n  \n{"step": 1}\n')
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


@pytest.mark.parametrize(("length", "cut"), [(80, False), (81, True)])
def test_a_damaged_line_is_quoted_whole_up_to_80_characters_then_cut_with_an_ellipsis(tmp_path, length, cut):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"step": 0}\n' + b"x" * length + b"\n")
    with pytest.raises(ConfigError) as info:
        list(read_jsonl(path))
    assert str(info.value) == (f"{path}, line 2: expected one JSON object per line, got {'x' * 80!r}"
                               + ("..." if cut else ""))


def test_a_locked_folders_cleanup_removes_a_temporary_whatever_its_timestamp(tmp_path):
    # older_than_s=0 is for a folder no other process can own (a locked run folder): a temporary file whose mtime is
    # ahead of this host's clock (NFS server skew, a copy that kept its times) must go too.
    future = tmp_path / ".out.bin.abcd1234.tmp"
    future.write_bytes(b"half")
    os.utime(future, (time.time() + 3600, time.time() + 3600))
    assert remove_temporaries(tmp_path, older_than_s=0) == [future]
    assert not future.exists()


def test_a_record_that_is_not_strict_json_is_refused_and_the_log_stays_readable(tmp_path):
    path = tmp_path / "results.jsonl"
    with JsonlAppender(path) as log:
        log.append({"step": 0})
        with pytest.raises(ValueError):
            log.append({"step": 1, "latency_s": float("nan")})  # NaN is no JSON: jq and strict readers refuse it
    assert path.read_bytes() == b'{"step":0}\n'


def test_only_whole_temporary_names_are_removed(tmp_path):
    # A locked run folder's cleanup (older_than_s=0) must not take a user's file that merely contains such a name.
    temporary = tmp_path / ".out.bin.abcd1234.tmp"
    kept = [tmp_path / ".out.bin.abcd1234.tmp.bak", tmp_path / "copy.out.bin.abcd1234.tmp"]
    for path in (temporary, *kept):
        path.write_bytes(b"x")
    assert remove_temporaries(tmp_path, older_than_s=0) == [temporary]
    assert all(path.exists() for path in kept)


@pytest.mark.parametrize("image", [np.zeros((2, 2, 3), np.float32), np.zeros((2, 2, 3), np.int16),
                                   np.zeros((2, 2, 4), np.uint8), np.zeros((2, 2, 1), np.uint8),
                                   np.zeros(4, np.uint8)], ids=["float32", "int16", "rgba", "1-channel", "1-d"])
def test_encode_png_refuses_an_image_it_would_write_wrong(image):
    # float or int16 pixels would be written as their raw bytes; 4 channels under an RGB header: a garbled picture.
    with pytest.raises(ValueError, match=r"^expected a uint8 \(H, W, 3\) or \(H, W\) image, got "):
        encode_png(image)


def test_a_grey_png_decodes_to_the_same_pixels():
    image = np.random.default_rng(0).integers(0, 255, (5, 7), dtype=np.uint8)
    chunks = dict(_png_chunks(encode_png(image)))
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (width, height, depth, color) == (7, 5, 8, 0)  # greyscale
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(5, 1 + 7)
    assert (rows[:, 0] == 0).all()
    np.testing.assert_array_equal(rows[:, 1:], image)


def test_only_an_image_shaped_uint8_array_is_a_frame_and_of_a_video_the_last_frame():
    from ardiff_cli.io.png import as_rgb_frame

    assert as_rgb_frame(np.zeros((5, 3), np.uint8)) is None  # 5 positions of 3 coordinates: no picture
    assert as_rgb_frame(np.zeros(3, np.uint8)) is None
    assert as_rgb_frame(np.zeros((4, 6, 3), np.float32)) is None
    video = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    np.testing.assert_array_equal(as_rgb_frame(video), video[-1])


def test_small_frames_are_scaled_up_by_a_whole_factor_to_at_least_min_height():
    from ardiff_cli.io.png import preview_strip

    frame = np.full((40, 30, 3), 7, np.uint8)
    strip = preview_strip([frame], [None], gap=2, min_height=96)
    assert strip.shape == (2 * 120 + 2, 90, 3)  # x3 (120 >= 96), not x2 (80): proportions kept
    assert (strip[:120] == 7).all()


def test_a_strip_has_a_column_for_every_step_that_has_either_frame():
    from ardiff_cli.io.png import preview_strip

    frame = np.full((4, 4, 3), 9, np.uint8)
    strip = preview_strip([frame], [frame, frame], gap=1)  # the last step's observation not (yet) drawn
    assert strip.shape == (9, 9, 3)
    assert (strip[5:, 5:] == 9).all() and (strip[:4, 5:] == 32).all()


def test_the_index_of_kept_snapshots_gives_back_only_what_this_run_may_restore(tmp_path):
    """--resume restores the sessions read_kept names from the files it names, then deletes them: an index of another
    run or format, and entries naming a file outside the swap folder or no step count (0, true), give nothing to
    restore (those sessions are replayed); kept_for names the run only for an index this version wrote."""
    snapshot = "0123456789abcdef" * 2 + ".safetensors"
    write_kept(tmp_path, {"arm_a": (snapshot, 2)}, run=1234.5)
    assert read_kept(tmp_path, run=1234.5) == {"arm_a": (snapshot, 2)} and kept_for(tmp_path) == 1234.5
    assert read_kept(tmp_path, run=1234.75) == {}  # two runs' .swap linked to one folder: the other run's index
    index = tmp_path / "kept.json"
    written = json.loads(index.read_text())
    damaged = {"up": {"file": "../../" + snapshot, "steps": 2}, "none": {"file": snapshot, "steps": 0},
               "bool": {"file": snapshot, "steps": True}, "text": {"file": snapshot, "steps": "2"},
               "pair": [snapshot, 2]}  # not an entry: it used to be read as one (AttributeError, every resume)
    index.write_text(json.dumps({**written, "sessions": {**written["sessions"], **damaged}}))
    said = []
    assert read_kept(tmp_path, run=1234.5, warn=said.append) == {"arm_a": (snapshot, 2)}
    assert said == [f"{index}: the entries of 5 episodes (up, none, bool, ...) name no snapshot file and step count "
                    "this version reads: those episodes replay their done steps instead"]
    for other, why in (({"format": "ardiff-kept-2"}, "its format is 'ardiff-kept-2', not 'ardiff-kept-1'"),
                       ({"run": True}, "it names another run")):  # a later version's index; a run that is no time
        index.write_text(json.dumps({**written, **other}))
        said = []
        assert read_kept(tmp_path, run=1234.5, warn=said.append) == {} and kept_for(tmp_path) is None
        assert said == [f"{index} is ignored ({why}): the swap snapshots a stopped run kept there are deleted, and an "
                        "episode still to run replays its done steps instead"]
    drop_kept(tmp_path)
    said = []
    assert not index.exists() and read_kept(tmp_path, run=1234.5, warn=said.append) == {} and not said
    assert kept_for(tmp_path) is None
    drop_kept(tmp_path)  # nothing left to delete: no error
