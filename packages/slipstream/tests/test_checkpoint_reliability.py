"""Checkpoint reliability: checksums, transactional loads, crash-safe saves, agreement across ranks.

Each worker is one spawned world that runs many checks (spawning is the cost on CI); the kill -9
tests run a saving loop in a subprocess and kill it at random moments (tests/_checkpoint_killer.py).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from slipstream.comm.testing import run_distributed

GLOBAL_BATCH = 8


def _engine(stage: int, seed: int = 0, dim: int = 16, optimizer: str = "AdamW", zero=None, **extra):
    import slipstream
    from slipstream.zero.testing import TinyTransformer

    torch.manual_seed(seed)
    params = {"lr": 0.01, "weight_decay": 0.01} if optimizer == "AdamW" else {"lr": 0.1}
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "steps_per_print": 1000,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, **(zero or {})},
        **extra,
    }
    engine, *_ = slipstream.initialize(model=TinyTransformer(dim=dim), config=config)
    return engine


def _train(engine, first: int, last: int) -> None:
    from slipstream import comm
    from slipstream.zero.testing import batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    micro = GLOBAL_BATCH // world
    for step in range(first, last):
        ids, labels = batch_for(step, 0, GLOBAL_BATCH)
        mine = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(ids[mine], labels[mine]))
        engine.step()


def _snapshot(engine) -> dict[str, torch.Tensor]:
    """Every parameter, master and optimizer-state tensor of this rank (for 'unchanged')."""
    out = {f"param/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for index, group in enumerate(engine.optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            out[f"master/{index}/{j}"] = param.detach().clone()
            for key, value in engine.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"state/{index}/{j}/{key}"] = value.detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return "NO ERROR", ""


def _flip_byte(path: Path, offset_from_end: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------- one rank, stage 0
def _single_rank_worker(root: str) -> dict:
    from slipstream.runtime import checkpoint as ckpt
    from slipstream.runtime import checkpoint_store as store

    results: dict = {}
    base = Path(root)
    engine = _engine(stage=0)
    _train(engine, 0, 2)
    engine.save_checkpoint(base, tag="good")

    # 1. checksums: a flipped byte inside tensor data (size unchanged) is refused...
    engine.save_checkpoint(base, tag="flipped", save_latest=False)
    _flip_byte(base / "flipped" / "optimizer.safetensors")
    before = _snapshot(engine)
    results["flip"] = _outcome(lambda: engine.load_checkpoint(base, tag="flipped"))
    results["flip_unchanged"] = _same(before, _snapshot(engine))
    # ... unless verification is switched off in the config (it then loads the damage).
    loose = _engine(stage=0, checkpoint={"verify_checksums": False})
    results["flip_unverified"] = _outcome(lambda: loose.load_checkpoint(base, tag="flipped"))

    # 2. transactional: AdamW state into an SGD engine; a larger and a smaller model.
    sgd = _engine(stage=0, optimizer="SGD")
    _train(sgd, 0, 1)
    before = _snapshot(sgd)
    results["adamw_into_sgd"] = _outcome(lambda: sgd.load_checkpoint(base, tag="good"))
    results["sgd_unchanged"] = _same(before, _snapshot(sgd))
    for name, dim in (("larger_into_smaller", 8), ("smaller_into_larger", 32)):
        other = _engine(stage=0, dim=dim)
        _train(other, 0, 1)
        before = _snapshot(other)
        results[name] = _outcome(lambda o=other: o.load_checkpoint(base, tag="good"))
        results[name + "_unchanged"] = _same(before, _snapshot(other))

    # 5. non-finite weights are refused, 'latest' stays; forcing writes them.
    with torch.no_grad():
        engine.module.block.ln1.weight[0] = float("nan")
    results["nan"] = _outcome(lambda: engine.save_checkpoint(base, tag="nan"))
    results["nan_latest"] = (base / "latest").read_text()
    results["nan_dir"] = (base / "nan").exists()
    engine.save_checkpoint(base, tag="nan_forced", save_latest=False, allow_non_finite=True)
    results["nan_forced"] = (base / "nan_forced" / "manifest.json").is_file()

    # 6. ENOSPC while writing (an injected writer): a named error, nothing half-visible.
    fresh = _engine(stage=0, seed=1)
    real_save = ckpt._save_tensors

    def full_disk(path, tensors, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    ckpt._save_tensors = full_disk
    try:
        results["enospc"] = _outcome(lambda: fresh.save_checkpoint(base, tag="good"))
    finally:
        ckpt._save_tensors = real_save
    results["enospc_leftovers"] = sorted(p.name for p in base.iterdir() if p.name.startswith("."))

    # 3. crash inside the switch of a re-saved tag, where the file system cannot exchange
    # directories: 'latest' still loads (from the complete hidden copy) and the next save
    # restores it instead of deleting both copies.
    real_exchange, real_replace = store._exchange, os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated kill between the two renames")
        real_replace(src, dst)

    store._exchange = lambda first, second: False
    os.replace = crash_on_second
    try:
        _outcome(lambda: fresh.save_checkpoint(base, tag="good"))
    except KeyboardInterrupt:
        pass
    finally:
        store._exchange, os.replace = real_exchange, real_replace
    results["window_tag_missing"] = not (base / "good").exists()
    restored = _engine(stage=0, seed=2)
    restored.load_checkpoint(base)  # latest = "good": its new, complete copy under a hidden name
    newest = _snapshot(fresh)
    results["window_loaded_good"] = _same(newest, _snapshot(restored))
    fresh.save_checkpoint(base, tag="other", save_latest=False)  # a save recovers leftovers
    results["window_after_save"] = sorted(p.name for p in base.iterdir())
    again = _engine(stage=0, seed=3)
    again.load_checkpoint(base, tag="good")
    results["window_good_again"] = _same(newest, _snapshot(again))

    # Re-saving an existing tag with the atomic exchange leaves one complete copy.
    engine2 = _engine(stage=0)
    _train(engine2, 0, 3)
    engine2.save_checkpoint(base, tag="good")
    results["resave_leftovers"] = sorted(p.name for p in base.iterdir() if p.name.startswith("."))
    check = _engine(stage=0, seed=4)
    check.load_checkpoint(base, tag="good")
    results["resave_loaded"] = _same(_snapshot(engine2), _snapshot(check))
    return results


def test_single_rank_checks(tmp_path: Path) -> None:
    (r,) = run_distributed(_single_rank_worker, 1, str(tmp_path / "ckpt"), timeout=300)
    assert r["flip"][0] == "CorruptCheckpointError" and "checksum" in r["flip"][1], r["flip"]
    assert "optimizer.safetensors" in r["flip"][1]
    assert r["flip_unchanged"]
    assert r["flip_unverified"][0] == "NO ERROR"
    assert r["adamw_into_sgd"][0] == "CheckpointMismatchError", r["adamw_into_sgd"]
    assert "AdamW" in r["adamw_into_sgd"][1] and "SGD" in r["adamw_into_sgd"][1]
    assert r["sgd_unchanged"]
    for name in ("larger_into_smaller", "smaller_into_larger"):
        assert r[name][0] == "CheckpointShapeError", r[name]
        assert "shape" in r[name][1] and "different model" in r[name][1]
        assert r[name + "_unchanged"]
    assert r["nan"][0] == "NonFiniteCheckpointError" and "NaN or inf" in r["nan"][1], r["nan"]
    assert r["nan_latest"] == "good" and not r["nan_dir"]
    assert r["nan_forced"]
    assert r["enospc"][0] == "CheckpointDiskFullError", r["enospc"]
    assert "No space left" in r["enospc"][1]
    assert r["window_tag_missing"]  # the simulated crash hit the window
    assert r["window_loaded_good"]
    assert "good" in r["window_after_save"]
    assert not [n for n in r["window_after_save"] if n.startswith(".")]
    assert r["window_good_again"]
    assert r["resave_leftovers"] == []
    assert r["resave_loaded"]


# ---------------------------------------------------------------------------- two ranks, ZeRO
def _two_rank_worker(root: str, blocker: str) -> dict:
    from slipstream import comm
    from slipstream.runtime import checkpoint as ckpt

    rank = comm.get_rank()
    base = Path(root)
    results: dict = {}
    engine = _engine(stage=2)
    _train(engine, 0, 2)
    engine.save_checkpoint(base, tag="good")
    good = _snapshot(engine)

    # 4. a save whose directory cannot be made (its parent is a file): the same error on both
    # ranks, no hang, and the engine goes on training and saving.
    results["parent_file"] = _outcome(lambda: engine.save_checkpoint(Path(blocker) / "ckpt"))
    # rank 1 alone runs out of space: both ranks raise the same CheckpointDiskFullError.
    real_save = ckpt._save_tensors
    if rank == 1:

        def full_disk(path, tensors, metadata=None):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        ckpt._save_tensors = full_disk
    try:
        results["enospc_rank1"] = _outcome(lambda: engine.save_checkpoint(base, tag="good"))
    finally:
        ckpt._save_tensors = real_save
    # rank 1 alone holds a NaN in its optimizer shard: both ranks refuse.
    if rank == 1:
        master = engine.optimizer.param_groups[0]["params"][0]
        saved_value = master.detach().clone()
        with torch.no_grad():
            master.view(-1)[0] = float("inf")
    results["nan_rank1"] = _outcome(lambda: engine.save_checkpoint(base, tag="bad"))
    if rank == 1:
        with torch.no_grad():
            master.copy_(saved_value)
    results["unchanged_after_failures"] = _same(good, _snapshot(engine))

    # 1. a flipped byte in rank 1's optimizer shard: both ranks refuse (whichever checked it).
    engine.save_checkpoint(base, tag="flipped", save_latest=False)
    comm.barrier()
    if rank == 0:
        _flip_byte(base / "flipped" / "optimizer.rank1.safetensors")
    comm.barrier()
    results["flip"] = _outcome(lambda: engine.load_checkpoint(base, tag="flipped"))

    # 2. a larger / smaller model's checkpoint into this one: a named shape error, unchanged.
    for name, dim in (("smaller_model", 8), ("larger_model", 32)):
        other = _engine(stage=2, dim=dim)
        _train(other, 0, 1)
        other.save_checkpoint(base, tag=name, save_latest=False)
        before = _snapshot(engine)
        results[name] = _outcome(lambda t=name: engine.load_checkpoint(base, tag=t))
        results[name + "_unchanged"] = _same(before, _snapshot(engine))

    # The last good checkpoint still loads and resumes exactly like the uninterrupted run.
    _train(engine, 2, 4)
    reference = _snapshot(engine)
    resumed = _engine(stage=2, seed=9)
    resumed.load_checkpoint(base)
    results["loaded_good"] = _same(good, _snapshot(resumed))
    _train(resumed, 2, 4)
    results["resumed_exactly"] = _same(reference, _snapshot(resumed))
    return results


def test_two_rank_checks(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    results = run_distributed(
        _two_rank_worker, 2, str(tmp_path / "ckpt"), str(blocker), timeout=300
    )
    for key in ("parent_file", "enospc_rank1", "nan_rank1", "flip"):
        assert results[0][key] == results[1][key], (key, results)  # the same error everywhere
    r = results[0]
    assert r["parent_file"][0] == "CheckpointSaveError", r["parent_file"]
    assert "not a directory" in r["parent_file"][1].lower()
    assert r["enospc_rank1"][0] == "CheckpointDiskFullError", r["enospc_rank1"]
    assert "failed on rank 1" in r["enospc_rank1"][1]
    assert r["nan_rank1"][0] == "NonFiniteCheckpointError" and "rank 1" in r["nan_rank1"][1]
    assert r["flip"][0] == "CorruptCheckpointError" and "checksum" in r["flip"][1]
    for result in results:
        assert result["unchanged_after_failures"]
        for name in ("smaller_model", "larger_model"):
            assert result[name][0] == "CheckpointShapeError", result[name]
            assert result[name + "_unchanged"]
        assert result["loaded_good"] and result["resumed_exactly"]


# ---------------------------------------------------------------------------- NVMe swap files
def _nvme_swap_corruption(swap_dir: str, root: str) -> dict:
    """A swap payload overwritten between steps: SwapFileCorruptError, not a step on garbage;
    the last checkpoint then resumes exactly."""
    from slipstream.offload.swap import HEADER_BYTES

    def build():
        offload = {"device": "nvme", "nvme_path": swap_dir}
        return _engine(
            stage=2,
            zero={"sub_group_size": 700, "offload_optimizer": offload},
            aio={"o_direct": False},
        )

    first = build()
    _train(first, 0, 2)
    first.save_checkpoint(root, tag="two")
    _train(first, 2, 3)
    with first._optimizer_resident():  # swapped-out tensors have no storage to read
        expected = _snapshot(first)
    space = first.zero.optimizer.offload.space
    victim = sorted(space.path.glob("*.exp_avg.swap"))[0]
    with open(victim, "r+b") as handle:
        handle.seek(HEADER_BYTES + 8)
        handle.write(b"\x7f" * 8)
    error = _outcome(lambda: _train(first, 3, 4))
    resumed = build()
    resumed.load_checkpoint(root, tag="two")
    _train(resumed, 2, 3)
    with resumed._optimizer_resident():
        same = _same(expected, _snapshot(resumed))
    return {"error": error, "victim": victim.name, "resumed": same}


def test_nvme_swap_payload_overwritten_between_steps(tmp_path: Path) -> None:
    swap = tmp_path / "nvme"
    swap.mkdir()
    (r,) = run_distributed(_nvme_swap_corruption, 1, str(swap), str(tmp_path / "ckpt"))
    assert r["error"][0] == "SwapFileCorruptError", r
    assert "checksum" in r["error"][1] and r["victim"] in r["error"][1]
    assert r["resumed"]


# ---------------------------------------------------------------------------- convert
def _make_checkpoint(root: str) -> None:
    engine = _engine(stage=1)
    _train(engine, 0, 1)
    engine.save_checkpoint(root, tag="t")


def test_convert_verifies_and_reports_user_errors(tmp_path: Path, capsys) -> None:
    from slipstream.cli import main

    root = tmp_path / "ckpt"
    run_distributed(_make_checkpoint, 1, str(root))
    assert main(["convert", str(root), str(tmp_path / "ok"), "--quiet"]) == 0
    capsys.readouterr()
    cases = {
        "missing": ([str(tmp_path / "nowhere"), str(tmp_path / "o1")], "does not exist"),
        "tag": ([str(root), str(tmp_path / "o2"), "--tag", "nope"], "'nope' not found"),
        "size": ([str(root), str(tmp_path / "o3"), "--max-shard-size", "lots"], "not understood"),
    }
    for name, (args, text) in cases.items():
        assert main(["convert", *args, "--quiet"]) == 2, name
        err = capsys.readouterr().err
        assert "slipstream convert: error:" in err and text in err, (name, err)
        assert "Traceback" not in err
    _flip_byte(root / "t" / "model.rank0.safetensors")
    assert main(["convert", str(root), str(tmp_path / "o4"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "does not match its checksum" in err and "model.rank0.safetensors" in err
    assert not (tmp_path / "o4" / "model.safetensors").exists()
    # --no-verify converts the damaged checkpoint (the user's explicit choice).
    assert main(["convert", str(root), str(tmp_path / "o5"), "--quiet", "--no-verify"]) == 0


# ---------------------------------------------------------------------------- kill -9
KILLER = Path(__file__).with_name("_checkpoint_killer.py")


def _kill_during_saves(root: Path, world: int, stage: int, seed: int) -> None:
    """Start the saving loop, let it save at least once, kill -9 it at a random moment."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, str(KILLER), str(root), str(world), str(stage)],
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,  # its spawned ranks share the session: killpg takes them all
    )
    try:
        assert process.stdout is not None
        started = time.monotonic()
        line = b""
        while b"saved" not in line:  # the first complete save
            line = process.stdout.readline()
            assert line, "the saving loop died before its first save"
            assert time.monotonic() - started < 240
        time.sleep(random.Random(seed).uniform(0.0, 1.5))
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _verify_after_kill(root: str) -> dict:
    """Load 'latest', compare with the weights the loop recorded, take one step, compare."""
    from slipstream import comm
    from slipstream.runtime.checkpoint import latest_tag

    config = json.loads((Path(root) / "config.json").read_text())
    engine = _engine(stage=config["stage"], seed=5)
    path, client = engine.load_checkpoint(root)
    step = client["step"]
    rank = comm.get_rank()
    expected = torch.load(Path(root) / "ref" / f"step{step}.rank{rank}.pt")
    loaded_ok = _same(expected, _snapshot(engine))
    following = Path(root) / "ref" / f"step{step + 1}.rank{rank}.pt"
    resumed_ok = None
    if following.exists():
        _train(engine, step, step + 1)
        resumed_ok = _same(torch.load(following), _snapshot(engine))
    return {"tag": latest_tag(root), "path": path.name, "loaded": loaded_ok, "resumed": resumed_ok}


def test_kill_9_during_saves_one_rank_resumes_exactly(tmp_path) -> None:
    root = tmp_path / "ckpt"
    _kill_during_saves(root, 1, 0, seed=11)
    (result,) = run_distributed(_verify_after_kill, 1, str(root), timeout=240)
    assert result["loaded"], result
    assert result["resumed"] in (True, None), result
    assert result["path"] == result["tag"]


def test_kill_9_during_saves_two_ranks_zero(tmp_path) -> None:
    """Two ranks at ZeRO-1 killed together: 'latest' is complete, verified and exact (read
    here without a process group: the consolidated fp32 weights against the loop's record)."""
    from slipstream.runtime.checkpoint import latest_tag
    from slipstream.runtime.zero_checkpoint import get_fp32_state_dict_from_zero_checkpoint

    root = tmp_path / "ckpt"
    _kill_during_saves(root, 2, 1, seed=22)
    state = get_fp32_state_dict_from_zero_checkpoint(root)  # verifies every checksum
    manifest = json.loads((root / str(latest_tag(root)) / "manifest.json").read_text())
    step = manifest["engine"]["global_steps"]
    expected = torch.load(root / "ref" / f"step{step}.full.pt")
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor.float()), name
