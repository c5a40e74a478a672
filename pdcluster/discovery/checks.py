"""Can this node serve: is a folder a usable checkpoint, can an address:port be listened on?

Each check gives one line saying why not ("" when fine), before any process loads or binds it.
Used by the CLI before `pdcluster replica`, `router`, `up` run, by `pdcluster launch` for the
router's ports, and by `pdcluster devices --check-model` on every node a launch uses (the folder
must be at the same path on each).
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path


def checkpoint_problem(folder: Path, weights: bool = True, tokenizer: bool = False) -> str:
    """Why `folder` cannot be served ("" when it can): missing folder, config.json, weights, tokenizer."""
    if not folder.exists():
        return f"model folder {folder} does not exist"
    if not folder.is_dir():
        return f"model path {folder} is not a folder"
    config = folder / "config.json"
    if not config.is_file():
        return f"model folder {folder} has no config.json (not a Hugging Face checkpoint)"
    problem = _json_problem(config)
    if problem:
        return problem
    from replica.errors import ReplicaError  # pure Python: the replica's own reading of config.json
    from replica.model.config import ModelConfig

    try:
        ModelConfig.from_dir(folder)
    except (ReplicaError, ValueError, KeyError, TypeError) as exc:  # CheckpointError, UnsupportedModel
        return f"model folder {folder}: {exc}"
    if weights and not any(folder.glob("*.safetensors")):
        return f"model folder {folder} has no *.safetensors weights"
    if tokenizer and not (folder / "tokenizer.json").is_file():
        return f"model folder {folder} has no tokenizer.json"
    optional = ["tokenizer_config.json", "generation_config.json"] + (["tokenizer.json"] if tokenizer else [])
    for name in optional:  # read by the router or the replica when present; a broken one fails them late
        problem = _json_problem(folder / name)
        if problem:
            return problem
    return ""


def _json_problem(path: Path) -> str:
    if not path.is_file():
        return ""
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{path} is not readable JSON: {exc}"
    return ""


def port_problem(host: str, port: int) -> str:
    """Why `host:port` cannot be listened on here ("" when it can, or when port is 0: any port)."""
    if port == 0:
        return ""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use"
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return ""
