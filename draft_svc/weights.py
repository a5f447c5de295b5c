"""Attaching to the primary's weights: map its segment zero-copy, build the model, follow restarts.

The primary exports its weights once (a `WeightManifest`: segment name or CUDA IPC handle and a
tensor table); this process maps them and builds a `Transformer` over the mapped views, so the
weights exist once on the machine. The draft pool's own memory is its per-request state.

How the attachment is kept current:
- `refresh()` asks the primary for its model info; when its instance id differs from the attached
  one (a restart), it fetches the new manifest and attaches to it. A monitor thread runs it every
  `poll_interval_s`, and at once after startup, so the service serves the model-free strategies
  while the primary is still loading (or down) and adds the model-based ones once attached.
- `current_model()` (called by every Propose) notices a vanished shared-memory segment (the
  primary exited and unlinked it) and wakes the monitor. The old mapping stays valid until the
  new one replaces it: an unlinked segment's pages live while mapped.
- `attach(exported)` validates everything before the switch: the manifest's fields
  (`specdec.weights.shared.attach`), the config, the tensor shapes (one smoke forward), and the
  draft strategies against the model; a bad one raises InvalidArgument naming the field.
- `attach_offered(exported)` (the Attach RPC) maps only the memory the primary itself exports:
  a caller cannot make this process map any other segment.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Protocol

import structlog
import torch

from specdec.engine.kv_cache import KVCache
from specdec.errors import FailedPrecondition, InvalidArgument, SpecdecError
from specdec.model.config import ModelConfig
from specdec.model.layout import count_layouts
from specdec.model.llama import SequenceSpan, Transformer
from specdec.weights.shared import KIND_SHARED_MEMORY, SHM_DIR, HandleError, WeightManifest, attach
from specdec.weights.wire import wire_field

SMOKE_TOKEN_ID = 0  # the one token of the attach-time smoke forward
# Ends the message of a refusal whose cause is an exception's own text (a JSON decoder's, torch's):
# the caller learns the field, the log the details.
SEE_LOG = "; the draft service's log has the details"


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    instance_id: str
    vocab_size: int
    max_context_length: int
    model_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ExportedWeights:
    manifest: WeightManifest
    config_json: str
    precision: str
    model_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class AttachedModel:
    instance_id: str
    model: Transformer
    manifest: WeightManifest
    precision: str
    model_id: str

    @property
    def mapped_bytes(self) -> int:
        return self.manifest.total_bytes


class PrimaryClient(Protocol):
    """The two primary RPCs attaching needs (draft_svc.primary_client.GrpcPrimaryClient)."""

    def get_model_info(self) -> ModelInfo: ...

    def export_weights(self) -> ExportedWeights: ...


ModelCheck = Callable[[Transformer], None]  # raises ValueError when the model does not suit the pool


class WeightAttacher:
    def __init__(
        self,
        client: PrimaryClient | None = None,
        check_model: ModelCheck | None = None,
        max_context: int = 0,
        poll_interval_s: float = 5.0,
        is_attaching: bool = True,
    ) -> None:
        self._client, self._check_model, self._is_attaching = client, check_model, is_attaching
        self._max_context, self._poll_interval_s = max_context, poll_interval_s
        self._attached: AttachedModel | None = None
        self._info: ModelInfo | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = structlog.get_logger("draft_svc.weights")

    # --- what the pool reads -------------------------------------------------------------------

    @property
    def attached(self) -> AttachedModel | None:
        return self._attached

    def current_model(self) -> tuple[str, Transformer] | None:
        attached = self._attached
        if attached is None:
            return None
        if attached.manifest.kind == KIND_SHARED_MEMORY and not (SHM_DIR / attached.manifest.segment_name).exists():
            self._wake.set()  # the primary may have restarted: check now, keep the valid old mapping meanwhile
        return attached.instance_id, attached.model

    def vocab_size(self) -> int | None:
        attached, info = self._attached, self._info
        if attached is not None:
            return attached.model.config.vocab_size
        return None if info is None else info.vocab_size

    def max_context_length(self) -> int | None:
        info = self._info
        return None if info is None or not info.max_context_length else info.max_context_length

    # --- attaching ---------------------------------------------------------------------------------

    def attach_offered(self, exported: ExportedWeights) -> AttachedModel:
        """attach() a manifest a caller offers, once the primary confirms it exports that memory."""
        if self._client is None:
            raise FailedPrecondition("manifest", "this draft pool has no primary_address to check a manifest against")
        return self.attach(exported, announced=self._client.export_weights().manifest)

    def attach(
        self,
        exported: ExportedWeights,
        instance_id: str | None = None,
        max_positions: int | None = None,
        announced: WeightManifest | None = None,
    ) -> AttachedModel:
        """Validate and map `exported`, then make it the current model (fields in errors: wire paths).
        announced: what the primary exports; `exported` must name the same memory."""
        m = exported.manifest
        config = _parse_config(exported.config_json)
        try:
            tensors = attach(m, announced)
        except HandleError as e:
            raise InvalidArgument(f"manifest.{wire_field(e.field)}", str(e).split(": ", 1)[-1]) from None
        positions = min(
            max_positions or config.max_position_embeddings, self._max_context or config.max_position_embeddings
        )
        try:
            model = Transformer(config, tensors, positions)
        except KeyError as e:
            raise InvalidArgument("manifest.tensors", f"tensor {e.args[0]!r} is missing") from None
        _smoke_forward(model)
        if self._check_model is not None:
            try:
                self._check_model(model)
            except ValueError as e:
                raise _refusal("manifest.model_config_json", "the draft strategies do not fit this model", e) from None
        attached = AttachedModel(instance_id or m.owner_instance_id, model, m, exported.precision, exported.model_id)
        self._attached = attached  # one reference swap: Propose threads see the old or the new model
        self._log.info(
            "weights_attached",
            instance_id=attached.instance_id,
            model_id=attached.model_id,
            precision=attached.precision,
            mapped_bytes=attached.mapped_bytes,
            kind=m.kind,
            # as the primary recorded them; read from the tensor names when its manifest carries none
            weight_layouts=count_layouts(model.matrices.values()),
            is_layouts_recorded=bool(m.matrices),
        )
        return attached

    def refresh(self) -> AttachedModel | None:
        """Ask the primary who it is; (re-)attach when its instance differs. Raises SpecdecError
        (Unavailable when the primary cannot be reached, InvalidArgument for a bad manifest)."""
        if self._client is None:
            return self._attached
        info = self._client.get_model_info()
        self._info = info
        attached = self._attached
        if not self._is_attaching or (attached is not None and attached.instance_id == info.instance_id):
            return attached
        self._log.info(
            "primary_instance_changed", old=None if attached is None else attached.instance_id, new=info.instance_id
        )
        return self.attach(
            self._client.export_weights(), instance_id=info.instance_id, max_positions=info.max_context_length or None
        )

    # --- the monitor thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._client is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._monitor, name="weights-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _monitor(self) -> None:
        is_failing = False  # a primary that stays down is reported once, not every poll
        while not self._stop.is_set():
            try:
                self.refresh()
                is_failing = False
            except SpecdecError as e:
                (self._log.debug if is_failing else self._log.warning)("attach_failed", error=str(e))
                is_failing = True
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                self._log.exception("attach_failed")
            self._wake.wait(self._poll_interval_s)
            self._wake.clear()


def _parse_config(text: str) -> ModelConfig:
    """A ModelConfig from either Hugging Face config.json text or ModelConfig's own fields."""
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        own = {f.name for f in dataclasses.fields(ModelConfig)}
        if set(fields) <= own:
            fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
            return ModelConfig(**fields)
        return ModelConfig.from_hf_dict(fields)
    except (ValueError, TypeError, KeyError) as e:
        raise _refusal(
            "manifest.model_config_json",
            "not a usable model config (Hugging Face config.json or ModelConfig fields)",
            e,
        ) from None


def _smoke_forward(model: Transformer) -> None:
    """One token through every layer: a tensor whose shape disagrees with the config fails here, not in
    a request. It also faults the mapped pages in, so the first Propose does not pay for that."""
    kv = KVCache(model.config, model.kv_dtype, device=model.embed_tokens.device)
    slot = kv.allocate(1)
    device = model.embed_tokens.device
    try:
        logits = model.forward(
            torch.tensor([SMOKE_TOKEN_ID], device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            [SequenceSpan(0, 1, 0, slot.k, slot.v, None)],
        )
    except (RuntimeError, IndexError) as e:
        raise _refusal(
            "manifest.tensors", "the tensors do not fit the config (a one-token forward failed)", e
        ) from None
    if tuple(logits.shape) != (1, model.config.vocab_size):
        raise InvalidArgument(
            "manifest.tensors",
            f"logits of shape {tuple(logits.shape)} do not match vocab_size {model.config.vocab_size}",
        )


def _refusal(field: str, message: str, cause: Exception) -> InvalidArgument:
    """InvalidArgument naming the field; the cause's own text goes to the log, not to the caller."""
    structlog.get_logger("draft_svc.weights").warning(
        "attach_refused", field=field, error_type=type(cause).__name__, error=str(cause)
    )
    return InvalidArgument(field, message + SEE_LOG)
