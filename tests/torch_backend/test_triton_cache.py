"""``benches/gpu/triton_cache.py``: the Triton kernels compiled here, keyed for the device's build of
Triton and carried there, are found in its cache instead of compiled again."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
triton = pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))

from gpu.triton_cache import GROUP_PREFIX, entries, entry_name, pack, unpack  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _fake_entry(cache: Path, kernel: str, stages: tuple[str, ...]) -> Path:
    """An entry as Triton writes it: a file per stage and the group file naming them by absolute path."""
    entry = cache / entry_name(secrets.token_hex(32))
    entry.mkdir(parents=True)
    children = {}
    for suffix in stages:
        path = entry / f"{kernel}.{suffix}"
        path.write_bytes(secrets.token_bytes(64))
        children[path.name] = str(path)
    (entry / f"{GROUP_PREFIX}{kernel}.json").write_text(json.dumps({"child_paths": children}))
    return entry


def test_pack_and_unpack_carry_the_metadata_and_cubin_with_the_paths_made_absolute(tmp_path):
    cache, carried, there = tmp_path / "here", tmp_path / "carried", tmp_path / "there"
    stages = ("source", "ttir", "ttgir", "llir", "ptx", "cubin", "json")
    kernels = [_fake_entry(cache, f"_kernel_{i}", stages) for i in range(3)]
    _fake_entry(cache, "_cut_short", ("ttir", "json"))  # no cubin: not a compiled kernel
    assert pack(cache, carried) == 3
    assert pack(cache, tmp_path / "some", only={kernels[1].name}) == 1
    there.mkdir()
    assert unpack(carried, there) == 3
    assert entries(there) == 3
    for entry in kernels:
        (group,) = (there / entry.name).glob(f"{GROUP_PREFIX}*.json")
        children = json.loads(group.read_text())["child_paths"]
        assert sorted(Path(p).suffix for p in children.values()) == [".cubin", ".json"]
        for name, path in children.items():
            assert Path(path) == there / entry.name / name
            assert Path(path).read_bytes() == (entry / name).read_bytes()
    assert unpack(carried, there) == 0  # what is there already stays


def test_entry_names_are_tritons():
    from triton.runtime.cache import _base32

    for _ in range(8):
        digest = secrets.token_hex(32)
        assert entry_name(digest) == _base32(digest)


COMPILE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, sys.argv[1])
    from gpu.triton_cache import device_keys, entry_name

    @triton.jit
    def _scaled_copy(x, y, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n) * SCALE, mask=offs < n)

    if sys.argv[2] != "-":
        device_keys(Path(sys.argv[2]))
    src = ASTSource(fn=_scaled_copy, signature={"x": "*fp32", "y": "*fp32", "n": "i32", "SCALE": "constexpr",
                    "BLOCK": "constexpr"}, constexprs={"SCALE": float(sys.argv[3]), "BLOCK": 128})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"]
    print(entry_name(kernel.hash))
    """
)


def _compile(cache: Path, libtriton: Path | None, scale: float) -> str:
    """Compiles a small kernel for sm_90 into ``cache`` (keyed for ``libtriton``'s build if given) in a
    process of its own (no interpreter); returns its entry."""
    script = cache.parent / "compile_kernel.py"  # Triton reads a kernel's source from its file
    script.write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
    args = [sys.executable, str(script), str(ROOT / "benches"), str(libtriton or "-"), str(scale)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_a_kernel_keyed_for_another_build_is_found_where_it_is_carried(tmp_path):
    other_build = tmp_path / "libtriton.so"  # the device's: another Python's build of this Triton
    other_build.write_bytes(secrets.token_bytes(4096))
    scale = 1.0 + secrets.randbelow(1000) / 7
    here, carried, there = tmp_path / "here", tmp_path / "carried", tmp_path / "there"
    entry = _compile(here, other_build, scale)
    assert pack(here, carried, only={entry}) == 1
    there.mkdir()
    assert unpack(carried, there) == 1
    carried_files = sorted(p.name for p in (there / entry).iterdir())
    assert _compile(there, other_build, scale) == entry
    assert sorted(p.name for p in (there / entry).iterdir()) == carried_files  # found, not compiled
    assert not any(name.endswith(".ptx") for name in carried_files)
    assert _compile(there, None, scale) != entry  # this build's own key is another entry
    assert entries(there) == 2
