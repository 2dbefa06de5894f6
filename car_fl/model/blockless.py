"""A node's share of a model whose blocks are remote: its embeddings and final norm, linked.

:func:`connect` loads the model with zero blocks and refuses a service whose model fingerprint
differs from the node's own files, before any text is sent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from car_fl.blocks.client import BlocksClient, BlocksRefused
from car_fl.blocks.parts import (
    blockless_kwargs,
    final_norm_name,
    identity_fingerprint,
    model_folder,
    node_tensor_names,
)
from car_fl.blocks.remote import RemoteBlocks
from car_fl.model.loading import EncoderLoadError, load_error, load_pretrained
from car_fl.settings.schema import ModelConfig

log = logging.getLogger(__name__)

#: The token a node sends to its blocks service (never a setting: settings travel).
TOKEN_ENV = "CAR_FL_BLOCKS_TOKEN"
#: A CA bundle that signs an https:// service's certificate.
CA_ENV = "CAR_FL_BLOCKS_CA"
#: The service of a party whose settings name none (the server of a simulation, whose nodes
#: read it too: car_fl.client.node): this machine's owner's environment.
SERVICE_ENV = "CAR_FL_BLOCKS_SERVICE"


def service_of(cfg: ModelConfig) -> str | None:
    """``model.blocks_service``, else this machine's ``CAR_FL_BLOCKS_SERVICE``."""
    return cfg.blocks_service or os.environ.get(SERVICE_ENV) or None


def service_identity(cfg: ModelConfig) -> dict[str, Any]:
    """What the feature cache names of ``cfg``'s blocks service: the model fingerprint, the
    digest of all its weights and its dtype (features from another service are another space)."""
    service = service_of(cfg)
    if not service:
        raise EncoderLoadError("model.blocks=remote, but no blocks service is named")
    info = _client(service).health()
    return {key: info.get(key) for key in ("fingerprint", "weights", "dtype")}


def _client(url: str) -> BlocksClient:
    return BlocksClient(
        url, token=os.environ.get(TOKEN_ENV) or None, ca_file=os.environ.get(CA_ENV)
    )


def connect(
    cfg: ModelConfig, name: str, *, dtype: torch.dtype, device: torch.device
) -> tuple[Any, RemoteBlocks]:
    """The node's blockless model of ``name`` and the remote blocks it is checked against."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    service = service_of(cfg)
    if service:
        cfg = dataclasses.replace(cfg, blocks_service=service)
    if not cfg.blocks_service:
        raise EncoderLoadError(
            "model.blocks=remote, but no blocks service is named: on a node, --node-config "
            "blocks-service=URL (listed in its policy's blocks-services) or CAR_FL_BLOCKS_SERVICE; "
            "for car-fl train/retrieve/ask, model.blocks_service=URL"
        )
    if cfg.layer != -1:
        raise EncoderLoadError(
            f"model.layer={cfg.layer} with model.blocks=remote: the service returns the last "
            "block's states only; use model.layer=-1 or model.blocks=local"
        )
    try:
        config = AutoConfig.from_pretrained(name, revision=cfg.revision)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the blocks' tensors are "unexpected": by design
        try:
            model = load_pretrained(
                AutoModel,
                name,
                dtype=dtype,
                device=device,
                revision=cfg.revision,
                **blockless_kwargs(config),
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        mine = identity_fingerprint(model_folder(name, cfg.revision), node_tensor_names(model))
    except Exception as err:
        raise load_error(name, "embeddings and final norm", err, cfg.revision) from err
    model.to(device)
    client = _client(cfg.blocks_service)
    try:
        info = client.health()  # BlocksUnavailable goes up as it is: the round's failure code
    except BlocksRefused as err:
        raise EncoderLoadError(str(err)) from err
    if info.get("fingerprint") != mine:
        raise EncoderLoadError(
            f"the blocks service at {cfg.blocks_service} holds {info.get('model')!r} (fingerprint "
            f"{info.get('fingerprint')}), not this node's {cfg.name_or_path} at revision "
            f"{cfg.revision or 'main'} ({mine}); start the service with the same model and "
            "revision, or point model.blocks_service at one that holds it"
        )
    if bool(info.get("norm_on_node")) != (final_norm_name(model) is not None):
        raise EncoderLoadError(
            f"the blocks service at {cfg.blocks_service} and this node disagree on who applies "
            "the final norm: run the same car-fl version on both"
        )
    log.info(
        "blocks of %s on %s: %s in %s, weights %s, %s replica(s)",
        cfg.name_or_path,
        cfg.blocks_service,
        info.get("model"),
        info.get("dtype"),
        info.get("weights"),
        info.get("replicas"),
    )
    return model, RemoteBlocks(client, mine)
