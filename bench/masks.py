"""The grammar mask's own work per constrained step, packed (the services' path) vs bool rows (the
reference every packed operation is tested against, and what the services did before).

    python -m bench masks [--tree-rows 9,33] [--reported-rows 3] [--repeats 5]

Masks are the real grammar's for every position of a JSON output (an array of objects: keys,
strings, booleans), a chain tree of R rows from each position; logits are random with the next
token of the output planted as each row's favourite (the model mostly agrees with the grammar).
Per step, summed over the services:
    gateway    encode the tree's mask for Verify and for Validate
    primary    decode and check it; the argmax among the allowed tokens
    validator  decode and check it; check the primary's argmax against it; mask the rows whose
               entropies the result reports (k rows: the accepted path and the stop row)
The reference packs bool rows for the wire, unpacks every row in both services, applies them with
a where over [R, V] and takes the entropy of every masked row. Filling the mask in the grammar
engine, the same for both, is not counted. Each figure is the fastest of --repeats (a shared
machine's preemptions are not cost), its median over positions, minus the same work without a mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdec import pb
from specdec.grammar import GrammarCache, GrammarTokenizerInfo, ResponseFormat, apply_token_mask, bitmask_to_bool
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from validator_svc.entropy import row_entropy
from specdec.flag_spellings import add_spellings

SCHEMA = {
    "type": "object",
    "required": ["rooms"],
    "properties": {
        "rooms": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["room", "clean"],
                "properties": {"room": {"type": "string"}, "clean": {"type": "boolean"}},
            },
        }
    },
}
OUTPUT = json.dumps(
    {
        "rooms": [
            {"room": f"the {name} on the ground floor", "clean": i % 2 == 0}
            for i, name in enumerate(("kitchen", "hall", "study", "pantry"))
        ]
    }
)


def pack_bool(allowed: torch.Tensor) -> bytes:
    """bool [R, V] -> TokenMask bytes, as the gateway encoded bool rows."""
    num_rows, vocab_size = allowed.shape
    padded = np.zeros((num_rows, pb.token_mask_row_bytes(vocab_size) * 8), dtype=np.bool_)
    padded[:, :vocab_size] = allowed.numpy()
    return np.packbits(padded, axis=1, bitorder="little").tobytes()


def unpack_bool(bits: bytes, vocab_size: int) -> torch.Tensor:
    """TokenMask bytes -> bool [R, V], as the primary and the validator decoded them."""
    packed = np.frombuffer(bits, dtype=np.uint8).reshape(-1, pb.token_mask_row_bytes(vocab_size))
    unpacked = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(unpacked).view(np.bool_))


def fastest_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree-rows", default="9,33", help="comma list of rows R per tree (draft nodes + 1)")
    p.add_argument("--reported-rows", type=int, default=3, help="rows whose entropy the validator reports")
    p.add_argument("--repeats", type=int, default=5)
    args = add_spellings(p).parse_args()
    torch.set_num_threads(1)  # as the validator and the gateway run
    model_dir = resolve_model_dir(None, default_cache_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammar = GrammarCache(GrammarTokenizerInfo.from_tokenizer(tokenizer, vocab_size)).compile(
        ResponseFormat("json_schema", json.dumps(SCHEMA))
    )
    output_ids = tokenizer.encode(OUTPUT)
    generator = torch.Generator().manual_seed(0)
    for num_rows in (int(r) for r in args.tree_rows.split(",")):
        reported = list(range(min(args.reported_rows, num_rows)))
        packed_ms, reference_ms = [], []
        state = grammar.new_state()
        for position in range(len(output_ids) - num_rows):
            chain = output_ids[position : position + num_rows - 1]
            logits = torch.randn(num_rows, vocab_size, generator=generator) * 3  # [R, V]
            logits[torch.arange(num_rows), torch.tensor(output_ids[position : position + num_rows])] = 20.0
            mask = state.tree_masks(chain, list(range(-1, num_rows - 2))).allowed
            engine_words = torch.from_numpy(mask.words.astype(np.int32))  # [R, W]

            def packed() -> None:
                wire = [pb.token_mask_to_pb(mask) for _ in range(2)]  # gateway
                argmax = pb.token_mask_from_pb(wire[0], num_rows, vocab_size, "m").argmax(logits)  # primary
                received = pb.token_mask_from_pb(wire[1], num_rows, vocab_size, "m")  # validator
                assert received.is_allowed(np.arange(num_rows), argmax.numpy()).all()
                row_entropy(received.masked_rows(logits, reported))

            def packed_unmasked() -> None:
                torch.argmax(logits, dim=-1)
                row_entropy(logits[reported])

            def reference() -> None:
                allowed = bitmask_to_bool(engine_words, vocab_size)  # gateway: [R, V]
                wire = [pack_bool(allowed) for _ in range(2)]
                torch.argmax(apply_token_mask(logits, unpack_bool(wire[0], vocab_size)), dim=-1)  # primary
                row_entropy(apply_token_mask(logits, unpack_bool(wire[1], vocab_size)))  # validator

            def reference_unmasked() -> None:
                torch.argmax(logits, dim=-1)
                row_entropy(logits)

            packed_ms.append(fastest_ms(packed, args.repeats) - fastest_ms(packed_unmasked, args.repeats))
            reference_ms.append(fastest_ms(reference, args.repeats) - fastest_ms(reference_unmasked, args.repeats))
            assert state.accept_tokens(output_ids[position : position + 1])
        print(
            f"tree rows {num_rows}, {len(reported)} reported, {len(packed_ms)} positions: mask work per step "
            f"packed {statistics.median(packed_ms):.3f} ms, bool rows {statistics.median(reference_ms):.3f} ms"
        )


if __name__ == "__main__":
    main()
