"""Triton's on-disk kernel cache, carried to the lent GPU machine so that its run loads the kernels
instead of compiling them inside its device minutes.

``precompile.py --libtriton`` fills a cache here with the entries the device's Triton will look for
(``device_keys``); ``pack`` copies what loading a kernel needs out of it (each entry's metadata and
cubin, and its group file with paths relative to the entry); on the device, ``unpack`` puts them into
that machine's cache with the group files' paths made absolute again, as Triton reads them.

    python benches/gpu/triton_cache.py pack CACHE_DIR OUT_DIR [--manifest FILE]
    python benches/gpu/triton_cache.py unpack CARRIED_DIR [CACHE_DIR]   # default: Triton's own

An entry is a directory named by the key's hash. Triton finds a compiled kernel through the entry's
``__grp__<name>.json`` (``{"child_paths": {file name: absolute path}}``) and loads the files it lists:
the ``.json`` metadata and the ``.cubin`` are all a launch reads (``CompiledKernel``), so the other
stages (``.ttir`` ... ``.ptx``) stay behind."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import sys
from pathlib import Path

GROUP_PREFIX = "__grp__"
KEPT_SUFFIXES = (".json", ".cubin")


def device_keys(libtriton: Path) -> str:
    """Makes this process's Triton key its cache entries as a Triton of the same version whose native
    library is ``libtriton`` would (the same wheel built for another Python: its Python files are the
    same, its ``libtriton.so`` is not, and the key hashes it); returns the key."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime import cache

    if invalidating := get_cache_invalidating_env_vars():  # they enter every key; the device sets none
        raise RuntimeError(f"unset {', '.join(sorted(invalidating))}: they would change every key")
    local_key = cache.triton_key()
    here = _sha256(Path(cache.__file__).parents[1] / "_C" / "libtriton.so")
    if here not in local_key:
        raise RuntimeError("this Triton's key does not hash its libtriton.so as expected")
    key = local_key.replace(here, _sha256(libtriton))
    cache.triton_key = lambda: key  # get_cache_key looks the name up at each call
    return key


def entry_name(kernel_hash: str) -> str:
    """The cache entry (directory) of a compiled kernel whose ``CompiledKernel.hash`` is ``kernel_hash``."""
    return base64.b32encode(bytes.fromhex(kernel_hash)).decode().rstrip("=")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pack(cache_dir: Path, out_dir: Path, only: set[str] | None = None) -> int:
    """Copies each complete entry's loading files (of the entries named in ``only``, if given) into
    ``out_dir``; returns how many entries."""
    packed = 0
    for group in sorted(cache_dir.glob(f"*/{GROUP_PREFIX}*.json")):
        if only is not None and group.parent.name not in only:
            continue
        children = json.loads(group.read_text()).get("child_paths") or {}
        kept = {name: name for name in children if name.endswith(KEPT_SUFFIXES)}
        if not any(name.endswith(".cubin") for name in kept):
            continue  # not a compiled kernel (a launcher, or an entry cut short)
        if not all((group.parent / name).exists() for name in kept):
            continue
        target = out_dir / group.parent.name
        target.mkdir(parents=True, exist_ok=True)
        for name in kept:
            shutil.copy2(group.parent / name, target / name)
        (target / group.name).write_text(json.dumps({"child_paths": kept}))
        packed += 1
    return packed


def unpack(carried_dir: Path, cache_dir: Path) -> int:
    """Puts the carried entries into ``cache_dir`` (an entry already there is kept); returns how many
    were added."""
    added = 0
    for entry in sorted(p for p in carried_dir.iterdir() if p.is_dir()):
        target = cache_dir / entry.name
        if target.exists():
            continue
        shutil.copytree(entry, target)
        for group in target.glob(f"{GROUP_PREFIX}*.json"):
            children = json.loads(group.read_text())["child_paths"]
            absolute = {name: str(target / name) for name in children}
            group.write_text(json.dumps({"child_paths": absolute}))
        added += 1
    return added


def default_cache_dir() -> Path:
    """Where this process's Triton keeps its cache (``TRITON_CACHE_DIR``, else under ``TRITON_HOME``)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def entries(cache_dir: Path) -> int:
    """How many entries (compiled kernels, launchers) ``cache_dir`` holds."""
    return sum(1 for p in cache_dir.iterdir() if p.is_dir()) if cache_dir.is_dir() else 0


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="copy a cache's loading files out")
    packing.add_argument("cache_dir", type=Path)
    packing.add_argument("out_dir", type=Path)
    packing.add_argument("--manifest", type=Path, help="only the entries it names (precompile --manifest)")
    unpacking = sub.add_parser("unpack", help="put carried entries into a cache")
    unpacking.add_argument("carried_dir", type=Path)
    unpacking.add_argument("cache_dir", type=Path, nargs="?")
    args = p.parse_args(argv)
    if args.command == "pack":
        only = set(args.manifest.read_text().split()) if args.manifest else None
        print(f"packed {pack(args.cache_dir, args.out_dir, only)} kernels into {args.out_dir}")
    else:
        cache_dir = args.cache_dir or default_cache_dir()
        cache_dir.mkdir(parents=True, exist_ok=True)
        print(f"unpacked {unpack(args.carried_dir, cache_dir)} kernels into {cache_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
