"""FlashInfer's JIT workspace and its downloaded cubins (two layers: the cubin dir can be set apart).

    $FLASHINFER_WORKSPACE_BASE (default $HOME)/.cache/flashinfer/   -> ROOT/flashinfer/.cache/flashinfer/
        [<version>/]<archs>/cached_ops/<op>/{build.ninja,.ninja_log,*.o,*.so}   JIT-built ops (ninja)
        [<version>/]<archs>/generated/                                            generated sources
        cubins/                                                                   downloaded cubins
        [<archs>/]cached_ops/<op>/lock                                            not carried
    $FLASHINFER_CUBIN_DIR, when set                                 -> ROOT/flashinfer_cubin/

Read in FlashInfer's flashinfer/jit/env.py (main of 2025; the 0.6 line adds the <version> level):
FLASHINFER_BASE_DIR = $FLASHINFER_WORKSPACE_BASE or Path.home(); the cache is <base>/.cache/flashinfer;
the cubin dir is the flashinfer-cubin package's, else $FLASHINFER_CUBIN_DIR, else <cache>/cubins.
The workspace name carries FlashInfer's version and target archs, so entries of another version or
GPU are never used (facts it depends on: engine.flashinfer, GPU SM, torch.cuda).

FlashInfer decides staleness with ninja (mtimes, kept by restore) and writes build.ninja with
absolute paths into its own workspace: a bundle hits only when FLASHINFER_WORKSPACE_BASE is the same
absolute path when compiling and when serving (kcache.env and examples/k8s set ROOT/flashinfer on
both). Under another path FlashInfer regenerates build.ninja and ninja rebuilds: slow, never wrong.
Up to 0.2.5 FlashInfer built each op with torch's cpp_extension.load() into cached_ops/<op>/, so torch's
FileBaton (cached_ops/<op>/lock, which torch waits on with no limit) is there while a build runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir


class FlashInferSource(Source):
    name = "flashinfer"
    needs_torch = True
    subdir = "flashinfer"
    env_var = "FLASHINFER_WORKSPACE_BASE"
    junk = COMMON_JUNK + ("lock",)  # torch's FileBaton in a 0.2 build folder: laid down, no pod loads the op

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        base = Path(env["FLASHINFER_WORKSPACE_BASE"]) if env.get("FLASHINFER_WORKSPACE_BASE") else home_dir(env)
        return [base / ".cache" / "flashinfer"]

    def restore_dir(self, root: Path) -> Path:
        return root / "flashinfer" / ".cache" / "flashinfer"

    def exports(self, root: Path) -> dict[str, str]:
        return {"FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer")}


class FlashInferCubinSource(Source):
    """Only where FLASHINFER_CUBIN_DIR points outside the workspace (inside it, the layer above carries it).

    Exported only when a restore laid cubins down: pointing FlashInfer at an empty directory would hide
    the cubins its default (<workspace cache>/cubins, inside the flashinfer layer) holds.
    """

    name = "flashinfer_cubin"
    subdir = "flashinfer_cubin"
    env_var = "FLASHINFER_CUBIN_DIR"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [Path(env["FLASHINFER_CUBIN_DIR"])] if env.get("FLASHINFER_CUBIN_DIR") else []

    def exports(self, root: Path) -> dict[str, str]:
        place = self.restore_dir(root)
        try:
            laid = place.is_dir() and any(place.iterdir())
        except OSError:  # not listable (a container of the pod may write ROOT): nothing there FlashInfer could use
            laid = False
        return {"FLASHINFER_CUBIN_DIR": str(place)} if laid else {}
