"""What run.json records of a run that ``ardiff rollout --resume`` checks again before it goes on.

A resume goes on with the run's config, checkpoint, pipeline module, episodes and settings, or is refused: each
check here compares what the command gives (or the machine has now) with what run.json recorded, and names the
file, the field, the recorded value and the given one. What the run records of its build (ardiff, torch, the
threads) only warns: the outputs left may differ in their last bits.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ardiff_cli.errors_cli import to_paste
from ardiff_cli.options import Order
from ardiff_cli.runtime.errors import (
    UTF8_LOCALE_HINT,
    ConfigError,
    ResumeCommand,
    as_typed,
    first_of,
    joined,
    link_to_nothing_on,
    plural,
    quoted,
    shell_word,
    unencodable,
)


RECORDED = {  # run.json's fields that --resume reuses unless given again -> what each takes
    "device": "cpu, cuda or cuda:N",
    "attention_backend": "torch or vllm",
    "memory_budget": "a byte size such as 536870912 or '512MiB'",
    "session_capacity": "a positive integer",
    "gpu_memory_fraction": "a number in (0, 1]",
    "swap_space": "a byte size such as 1073741824 or '1GiB' (0: no swapping)",
    "order": " or ".join(o.value for o in Order),
    "follow": "true or false",
    "preview": "true or false",
    "idle_timeout": "a number of seconds >= 0, or null",
}


def moved_name(path: Path, recorded: list[dict[str, Any]]) -> str | None:
    """The name of the run's episode whose folder moved to ``path``: of its recorded folders, the one whose path ends
    as ``path`` does in the most parts (``old/b/ep`` for ``new/b/ep``, not ``old/a/ep``, whichever order the resume
    gives them in: the order named them ``ep`` and ``ep-2``, and run.json records the paths it names); None where
    none, or several alike, do."""
    here = path.resolve().parts[::-1]
    tails = sorted(((next((i for i, (a, b) in enumerate(zip(here, Path(e["path"]).parts[::-1])) if a != b),
                           min(len(here), len(Path(e["path"]).parts))), e["name"]) for e in recorded), reverse=True)
    if not tails or tails[0][0] == 0 or len(tails) > 1 and tails[1][0] == tails[0][0]:
        return None
    return tails[0][1]


def refuse_other_watch(recorded: list[str], given: list[str], recorded_episodes: list[dict[str, Any]],
                        episodes: list[Any], out: Path | None) -> None:
    """A followed run resumed given other folders of episodes to watch than it recorded is refused (the episodes
    started meanwhile in a watched folder were not looked for), unless each recorded one not given is gone and moved
    to one given in its place: the only given folder not recorded that holds every episode of the run that was in it
    (by name). That resume then watches the folder where it is now, and run.json records it there."""
    from ardiff_cli.io.episode import listed, present

    missing = [folder for folder in recorded if folder not in given]
    extra = [folder for folder in given if folder not in recorded]
    gone = [folder for folder in missing if present(Path(folder)) is False]
    if gone == missing and len(extra) == len(missing):
        held = {folder: {e.name for e in episodes if str(e.path.resolve().parent) == folder} for folder in extra}
        moved = []
        for folder in missing:
            names = {e["name"] for e in recorded_episodes if str(Path(e["path"]).parent) == folder}
            moved += [new for new in extra if names and names <= held[new]]
        if sorted(moved) == sorted(extra):  # each gone folder found in exactly one given folder, and each once
            return
    hint = "resume with the same EPISODE arguments (or none, to reuse the recorded ones)"
    if gone:  # it cannot be given at its old path: the hint led nowhere
        hint = (f"{listed(gone)} moved since (gone): give it where it is now, holding the run's episodes that were "
                f"in it, with the run's other folders of episodes; or put a symlink at its old path to where it is "
                f"now (ln -s NEW {shell_word(gone[0])}) and resume with no EPISODE")
    raise ConfigError(f"the folders of episodes watched differ from those of the run in {out}: expected {recorded}, "
                      f"got {given}", hint=hint)


def links_in(folders: list[Path]) -> dict[str, Path]:
    """The links to folders directly in ``folders`` (a run's watched folders of episodes; hidden ones are no
    episodes), by the path each leads to; the first by name where several lead to one."""
    found: dict[str, Path] = {}
    for folder in folders:
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError:  # gone or unreadable: its episodes' own checks name it
            continue
        for entry in entries:
            if not entry.name.startswith(".") and entry.is_symlink() and os.path.isdir(entry.path):
                found.setdefault(os.path.realpath(entry.path), Path(entry.path))
    return found


def watched_folders(info: dict[str, Any], path: Path) -> list[Path]:
    """run.json's ``watch``: the folders of episodes the run was given (absolute), whose new episode folders a
    followed run adds; [] in a run.json of an older ardiff, which did not record them."""
    from ardiff_cli.runtime.errors import field_error

    value = info.get("watch", [])
    if isinstance(value, list) and all(isinstance(folder, str) and Path(folder).is_absolute() for folder in value):
        return [Path(folder) for folder in value]
    raise field_error(str(path), "watch", "a list of absolute folder paths", value,
                      hint="correct it there, or give the EPISODE arguments again")


def recorded_setting(info: dict[str, Any], key: str, path: Path) -> Any:
    """run.json's ``key`` (one of ``RECORDED``; None: not recorded), checked as its option is: a value edited by
    hand is a usage error naming the file and the field, not the command line, the engine or a traceback."""
    from ardiff_cli.runtime.capacity import parse_bytes
    from ardiff_cli.runtime.config import RuntimeConfig
    from ardiff_cli.runtime.errors import field_error

    value = info.get(key)
    if value is None:
        return None
    try:
        if key in ("follow", "preview"):
            if isinstance(value, bool):
                return value
        elif key == "order":
            if isinstance(value, str) and value in {o.value for o in Order}:
                return value
        elif key == "idle_timeout":
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:  # NaN is not
                return float(value)
        elif key == "swap_space":
            return parse_bytes(value, zero_ok=True)
        else:
            return getattr(RuntimeConfig().with_overrides(**{key: value}), key)
    except ConfigError:
        pass
    if key in ("device", "attention_backend"):  # what the run resolved: another given is refused (outputs would mix)
        raise field_error(str(path), key, RECORDED[key], value, hint="correct it there, to what the run ran with")
    raise field_error(str(path), key, RECORDED[key], value,
                      hint=f"correct it there, or give --{key.replace('_', '-')} to replace it")


def recorded_pythonpath_found(pipeline: str | None, again: ResumeCommand, run_file: Path) -> None:
    """Refuse a resume whose ``--pipeline MODULE:CLASS`` module is not found here, naming the folders run.json records
    the run imported it from (``again.pythonpath``: the run's resume, which carries them), where its import (as the
    config loads) said only `No module named ...` and to check the install. They still hold it, but are not
    searched here: the hint is the run's resume, which puts them on PYTHONPATH. One is gone since (a lab's folder
    renamed), or none holds it now: the hint is the resume with NEW, the folder that holds it now, first on
    PYTHONPATH (or put the gone one back). Nothing is checked where the module is found, or none were recorded."""
    import importlib.machinery
    import importlib.util

    top = (pipeline or "").partition(":")[0].strip().partition(".")[0]
    if not again.pythonpath or not top.isidentifier():
        return
    try:
        if importlib.util.find_spec(top) is not None:
            return
    except (ImportError, ValueError):
        return  # its import says what is wrong
    said = (f"--pipeline {pipeline}: cannot import {top!r}: the run imported it from one of the folders that "
            f"{run_file}'s field 'pythonpath' records")
    if importlib.machinery.PathFinder.find_spec(top, list(again.pythonpath)) is not None:
        raise ConfigError(f"{said}, which are not on PYTHONPATH here",
                          hint=f"continue with the run's resume, which gives them: {again}")
    gone = [folder for folder in again.pythonpath if not os.path.isdir(folder)]
    given = replace(again, pythonpath=("NEW", *(folder for folder in again.pythonpath if folder not in gone))).command()
    back = (f"put {'it' if len(gone) == 1 else 'them'} back (moved: a symlink there to where it is now will do, "
            f"ln -s NEW {shell_word(gone[0])}), then resume; or " if gone else "")
    raise ConfigError(f"{said}, and " + (f"{joined(gone, 'and')} {'is' if len(gone) == 1 else 'are'} gone" if gone else
                                         f"none of them ({first_of(again.pythonpath, 3)}) holds it now"),
                      hint=f"{back}give the folder that holds {top!r} now (NEW) on PYTHONPATH: {given}")


def recorded_folders_exist(info: dict[str, Any], out: Path, watch: list[Path], again: ResumeCommand) -> None:
    """The episode folders a resume of the run in ``out`` (run.json: ``info``) reads are where run.json last recorded
    them (where the run started them, or where it followed a rename: ``episode_moved``): one moved or deleted since
    is named as this run's (where a new run's missing EPISODE hints at --follow). A folder of episodes the run was
    given (run.json's ``watch``, with or without --follow) renamed while the run was stopped is named itself: a
    symlink at an episode's path cannot be made while the folder above it is gone, and the folder may be given where
    it is now instead (``refuse_other_watch`` takes it), with the run's other EPISODE arguments: ``again``, the
    resume as given, with its options."""
    from ardiff_cli.io.episode import MOUNT_HINT, listed, present
    from ardiff_cli.io.run import RUN_FILE

    episodes, run_file = info["episodes"], out / RUN_FILE
    for episode in episodes:  # resumed in another locale than the run's: there, but not a path this one can write
        if why := unencodable(episode["path"]):
            raise ConfigError(f"episode {episode['name']!r} of this run: its folder {episode['path']} (recorded in "
                              f"{run_file}): {why}", hint=UTF8_LOCALE_HINT)
    # None: there, on a path this user may no longer enter; its episode fails saying so
    gone = [(e["name"], e["path"]) for e in episodes if present(Path(e["path"])) is False]
    for folder in watch:
        inside = [name for name, path in gone if Path(path).parent == folder]
        if inside and present(folder) is False:
            # the resume given the run's EPISODE arguments, this folder where it is now (NEW) in its place
            others = [str(other) for other in watch if other != folder] + [
                e["path"] for e in episodes if Path(e["path"]).parent not in watch]
            given = again.command(more=[shell_word(info.get("config_path") or info["config"]), "NEW",
                                        *map(shell_word, others)])
            dangling = link_to_nothing_on(Path(folder))  # a link left where it moved (as hinted below), leading nowhere
            if dangling is not None:
                link, why = dangling
                raise ConfigError(f"{as_typed(folder)}, a folder of episodes given to this run, "
                                  + (f"is {why}" if link == Path(folder) else f"cannot be reached: {link} is {why}")
                                  + f" (the folders of its episodes {listed(inside)} are recorded in {run_file})",
                                  hint=MOUNT_HINT + f", then resume; or give it where it is now: {given}")
            raise ConfigError(f"{as_typed(folder)}, a folder of episodes given to this run, is gone, and with it the "
                              f"folders of its episodes {listed(inside)} (recorded in {run_file})",
                              hint="put it back at that path (renamed or moved: a symlink there to where it is now "
                                   f"will do, ln -s NEW {shell_word(folder)}), then resume; or give it where it is "
                                   "now, holding the run's episodes that were in it, with the run's other EPISODE "
                                   f"arguments: {given}; or run its episodes again in a new --out")
    if gone:
        name, path = gone[0]
        more = f" (and {plural(len(gone) - 1, 'more episode folder')})" if len(gone) > 1 else ""
        # a link left there, or at a folder above it, to where it moved, leading nowhere now
        dangling = link_to_nothing_on(Path(path))
        if dangling is not None:
            link, why = dangling
            where = f"is {why}{more}" if link == Path(path) else f"cannot be reached{more}: {link} is {why}"
            raise ConfigError(f"episode {name!r} of this run: its folder {as_typed(path)} (recorded in {run_file}) "
                              + where, hint=MOUNT_HINT + ", then resume; or run its episodes again in a new --out")
        raise ConfigError(f"episode {name!r} of this run: its folder {as_typed(path)} is gone{more}; {run_file} "
                          "records where the run last found each episode's folder (where it started, or where "
                          "--follow followed its rename)",
                          hint="put it back at that path (moved: a symlink there to where it is now will do), then "
                               "resume; or run its episodes again in a new --out")


def same_device(setting: str, recorded: str | None, *, load: bool = True) -> None:
    """``--resume`` runs where the run started: another device's numerics would mix into its outputs. Without
    ``load`` (nothing is left to run, and torch is not imported), only a device named outright (cpu, cuda:N) is
    compared, so that it is refused as it would be with steps left; auto and cuda are what torch finds: they pass."""
    if load:
        from ardiff_cli.runtime.engine import resolve_device

        try:
            here = str(resolve_device(setting))
        except ConfigError as exc:
            if setting != recorded:  # another device given: its own error
                raise
            raise ConfigError(f"this run was started on {recorded}, which is not available here ({exc})",
                              hint=f"resume it where {recorded} is: outputs are identical only on one device") from None
    elif setting == "cpu" or setting.startswith("cuda:"):  # device_name's spellings: cuda:N as torch writes it
        here = "cpu" if setting == "cpu" else f"cuda:{int(setting[5:])}"
    else:
        return
    if recorded is not None and here != recorded:
        raise ConfigError(f"this run was started on {recorded}, and --device {setting} resolves to {here} here",
                          hint=f"resume with --device {recorded} (outputs are identical only on one device)")


def recorded_backend_installed(setting: str, recorded: str | None, device: str | None) -> None:
    """A run that vLLM ran, resumed where vLLM is not installed, or is but its kernels do not load (its CUDA build on
    a CPU, an import that fails): said before the model loads, as the run's, not as
    an --attention-backend vllm the user did not give (whose hint, the torch backend, a resume refuses)."""
    from ardiff_cli.runtime.kv.backends import install_instructions, probe_vllm_cpu, probe_vllm_flash, vllm_installed

    if setting != "vllm" or recorded != "vllm":
        return
    device = device or "cpu"
    if not vllm_installed():
        raise ConfigError("this run was started with attention backend vllm, and vLLM is not installed here",
                          hint=f"install the extra to resume it: {install_instructions(device)}; outputs "
                               "are identical only with one attention backend")
    probe = probe_vllm_cpu() if device == "cpu" else probe_vllm_flash()
    if not probe.ok:
        raise ConfigError(f"this run was started with attention backend vllm, and vLLM's kernels cannot run here: "
                          f"{probe.reason}",
                          hint=f"repair the install to resume it: {install_instructions(device)}; outputs are "
                               "identical only with one attention backend")


def same_backend(here: str, setting: str, recorded: str | None) -> None:
    """``--resume`` attends with the kernel the run started with: vLLM's and torch's differ in the last bits, and
    replays and later steps would mix them into the outputs. Checked after load, where the choice is known."""
    if recorded is not None and here != recorded:
        raise ConfigError(f"this run was started with attention backend {recorded}, and --attention-backend "
                          f"{setting} picks {here} here",
                          hint=f"resume with --attention-backend {recorded} (outputs are identical only with one "
                          "attention backend)" + ("; vLLM must be installed for it" if recorded == "vllm" else ""))


def build_record() -> dict[str, Any]:
    """What an output's last bits depend on beside the device and attention backend, as run.json records it: this
    ardiff, this torch, and the CPU intra-op threads torch runs with (``runtime.num_threads``, else OMP_NUM_THREADS or
    one per core: kernels split over another count sum in another order). Once the engine has loaded (it sets the
    threads); torch is imported by then."""
    import torch

    from ardiff_cli import __version__

    return {"ardiff_version": __version__, "torch_version": str(torch.__version__),
            "torch_threads": torch.get_num_threads()}


def build_changes(recorded: dict[str, Any], now: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{field: {"recorded": ..., "now": ...}} of ``build_record``'s fields whose value differs from run.json's. A field
    run.json lacks (an older ardiff's) is not compared; nor are the threads of a run on a GPU, whose kernels do not
    split over them."""
    return {key: {"recorded": recorded[key], "now": value} for key, value in now.items()
            if recorded.get(key) is not None and recorded[key] != value
            and (key != "torch_threads" or str(recorded.get("device")) == "cpu")}


def build_changes_warning(changes: dict[str, dict[str, Any]], run_file: Path) -> str:
    """The warning of a resume whose ardiff, torch or thread count is not the run's: ``run_file`` and each field it
    recorded, with its value then and now (``runs/x/run.json: torch_threads 1, now 2``)."""
    fields = "; ".join(f"{key} {change['recorded']}, now {change['now']}" for key, change in changes.items())
    again = [f"{'ardiff' if key == 'ardiff_version' else 'torch'} {change['recorded']}"
             for key, change in changes.items() if key != "torch_threads"]
    if "torch_threads" in changes:  # a config that sets runtime.num_threads has the run's: it is null
        again.append(f"OMP_NUM_THREADS={changes['torch_threads']['recorded']}")
    return (f"{run_file}: {fields}: the outputs of the steps left may differ in the last bits from those of an "
            "uninterrupted run (the steps done are kept as they are); resume with "
            f"{', '.join(again)} for outputs identical to an uninterrupted run's")


def same_pipeline_option(given: str | None, recorded: str | None) -> None:
    """``--resume`` never imports code because a file (run.json) names it: the command line must say it again."""
    if given == recorded:
        return
    if recorded is None:
        raise ConfigError(f"the run used its config's pipeline, not --pipeline {given}",
                          hint="resume without --pipeline")
    message = (f"--pipeline {quoted(given)} differs from the run's {quoted(recorded)}" if given else
               f"the run used --pipeline {recorded}; ardiff imports code only when the command line "
               "names it")
    raise ConfigError(message, hint=f"resume with --pipeline {recorded}")


def resume_config(given: str | None, info: dict[str, Any], again: ResumeCommand) -> str:
    """The config file the run started with, by absolute path (that it is unchanged since, its SHA-256 in
    run.json, is checked on the bytes parsed: ``same_config``).

    A config named relatively would otherwise resolve against today's working folder, and an
    edited one would silently mix two models' outputs in one run. ``again``: the resume to paste instead.
    """
    from ardiff_cli.runtime.config import resolve_config

    if given is not None and Path(given).is_dir():  # it read "config file not found" of a folder that is there
        raise ConfigError(f"CONFIG {quoted(given)} is a folder; the first argument is a config file or a built-in "
                          "config name",
                          hint=to_paste("with --resume the config and episodes are the run's (run.json): leave "
                                        "them out, or give the config before them", again))
    recorded, digest = info.get("config_path"), info.get("config_sha256")
    if digest is None:  # run.json of an older ardiff: only the label was kept
        return same_as_recorded(given, info["config"], "CONFIG")
    path = Path(recorded) if given is None else resolve_config(given).absolute()
    if why := unencodable(path):  # resumed in another locale than the run's: "is gone" of a config that is there
        raise ConfigError(f"the run's config {recorded}: {why}", hint=UTF8_LOCALE_HINT)
    if not path.is_file():
        # run.json of an ardiff before '..' was dropped (`/x/lab/../fast.yaml`, lab/ renamed since): /x/fast.yaml is
        # the run's only if lab was no link, which nothing says now, so it is offered, not taken (its SHA-256 checked).
        # Not while lab is there: it is a link then (this ardiff keeps a '..' only after one), or the name was no
        # other than /x/fast.yaml
        lexical = Path(os.path.normpath(path))
        before = Path(*path.parts[:path.parts.index("..")]) if ".." in path.parts else path
        offered = "" if given is not None or os.path.lexists(before) or not lexical.is_file() else (
            f"; where no link comes before its '..', it is {lexical}: "
            f"{again.command(more=[shell_word(lexical)])}")
        raise ConfigError(f"the run's config {recorded} is gone",
                          hint=f"restore it, or pass the same CONFIG again{offered}")
    return str(path)


def same_config(path: Path, digest: str | None, info: dict[str, Any]) -> None:
    """Refuse to resume the run of ``info`` (run.json) with the config ``path`` whose bytes hash to ``digest``,
    unless they are the run's (``config_sha256``; older runs recorded none)."""
    recorded = info.get("config_path")
    if info.get("config_sha256") not in (None, digest):
        what = ("was edited since the run started" if _same_file(path, recorded)
                else f"differs from the run's {recorded}")
        raise ConfigError(f"config {path} {what} (SHA-256 differs)",
                          hint="resume with the config the run started with, or start a new run in another --out")


def _same_file(path: Path, recorded: str | None) -> bool:
    """Whether ``path`` is the file run.json recorded as ``recorded``, however spelt (`x/../my.yaml`, a link)."""
    try:
        return recorded is not None and os.path.samefile(path, recorded)
    except OSError:  # one of them is gone or cannot be reached: by name
        return str(path) == recorded


def config_sha256(path: Path) -> str | None:
    """The SHA-256 of the config file ``path`` as it is now, or None where it cannot be read (its load said why)."""
    from ardiff_cli.runtime.config import read_config_bytes

    try:
        return hashlib.sha256(read_config_bytes(path)).hexdigest()
    except (ConfigError, OSError):
        return None


def checkpoint_record(path: Path | None) -> dict[str, Any] | None:
    """run.json's ``checkpoint``: the config's weights file as path, size and modification time (hashing a 14B
    checkpoint would take a minute at every start); None for the pipeline's built-in default, built the same from
    the config, or a file gone since the config was read (loading it names it)."""
    if path is None:
        return None
    try:
        stat_result = Path(path).stat()
    except OSError:
        return None
    return {"path": str(Path(path).resolve()), "size": stat_result.st_size, "mtime_ns": stat_result.st_mtime_ns}


def refuse_changed_checkpoint(recorded: Any, now: dict[str, Any] | None) -> None:
    """A resume whose config reads another weights file than the run's, or the run's file replaced since (its size
    or modification time differ), is refused: the run's outputs so far came from the weights it had then, and a
    resumed run must equal an uninterrupted one. Nothing to compare in a run.json without the field (an older
    ardiff's) or where either side has the built-in default."""
    if not isinstance(recorded, dict) or now is None or not isinstance(recorded.get("path"), str):
        return
    if recorded["path"] != now["path"]:
        raise ConfigError(f"the config's checkpoint {now['path']} is not the run's, {recorded['path']}",
                          hint="resume with the config the run started with (a relative checkpoint path is read "
                               "from the config's folder), or start a new run in another --out")
    if (recorded.get("size"), recorded.get("mtime_ns")) == (now["size"], now["mtime_ns"]):
        return
    mtime = recorded.get("mtime_ns")
    known = isinstance(mtime, int) and not isinstance(mtime, bool)
    touch = (f"; if it holds the same weights (copied again), give it back its modification time: touch -d "
             f"@{mtime // 10**9}.{mtime % 10**9:09d} {shell_word(now['path'])}" if known else "")
    raise ConfigError(f"checkpoint {now['path']} changed since the run started (size {recorded.get('size')} bytes, "
                      f"modified {local_time(mtime / 1e9) if known else 'unknown'}; now {now['size']} bytes, "
                      f"modified {local_time(now['mtime_ns'] / 1e9)}): the run's outputs so far came from the "
                      "weights it had then",
                      hint=f"restore those weights to resume, or start a new run in another --out{touch}")


def local_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def same_as_recorded(given: Any, recorded: Any, name: str) -> Any:
    if given is not None and given != recorded:
        raise ConfigError(f"{name} {given!r} differs from the run's {recorded!r}",
                          hint=f"resume with the same {name}, or leave it out to reuse the recorded one")
    return recorded
