"""Multi-process runs from Python through the CLI's own launcher, `moeforge launch` (one process per
GPU or CPU rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, signals
forwarded, a failed rank stopping the others)."""

import os
import subprocess
import sys
from typing import Any, Mapping, Optional, Sequence, Union

from .engine import Recipe, _as_recipe
from .errors import Error, InvalidArgumentError


def binary() -> str:
    """The moeforge CLI next to this package (bin/moeforge), or $MOEFORGE_BINARY."""
    path = os.environ.get("MOEFORGE_BINARY") or os.path.join(os.path.dirname(__file__), "bin", "moeforge")
    if not os.access(path, os.X_OK):
        raise Error(f"the moeforge binary is not at {path} (build it: make python; or set MOEFORGE_BINARY)")
    return path


def launch(recipe: Union[Recipe, str, os.PathLike, Mapping[str, Any], None] = None, *, nproc_per_node: int,
           nnodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None, master_port: Optional[int] = None,
           script: Optional[str] = None, script_args: Sequence[str] = (), resume: Optional[str] = None,
           check: bool = True, **overrides: Any) -> int:
    """Runs `moeforge launch --nproc-per-node N ... -- finetune RECIPE overrides` (every rank a
    `moeforge finetune`), or with `script` every rank runs `python SCRIPT script_args` (which opens
    its own moeforge.Engine). Returns the launcher's exit status; with check, a non-zero one raises."""
    cmd = [binary(), "launch", "--nproc-per-node", str(nproc_per_node)]
    if nnodes != 1 or node_rank != 0:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if master_addr is not None:
        cmd += ["--master-addr", master_addr]
    if master_port is not None:
        cmd += ["--master-port", str(master_port)]
    if script is not None:
        if recipe is not None or overrides:
            raise InvalidArgumentError("launch: give a recipe (every rank runs finetune) or a script, not both")
        cmd += ["--program", sys.executable, "--", script, *script_args]
    else:
        if recipe is None:
            raise InvalidArgumentError("launch: a recipe (or a script) is required")
        r = _as_recipe(recipe).with_overrides(**overrides)
        if r.is_text:
            raise InvalidArgumentError("launch: the ranks read the recipe from a file; a recipe given as text or a "
                                       "dict has none (write it to a file, or use Recipe.from_file)")
        cmd += ["--", "finetune", r.source, *r.overrides]
        if resume is not None:
            cmd += ["--resume", resume]
    rc = subprocess.call(cmd)
    if check and rc != 0:
        raise Error(f"moeforge launch exited with status {rc}: {' '.join(cmd)}")
    return rc
