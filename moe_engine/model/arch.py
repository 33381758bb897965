"""Per-architecture tensor name tables: checkpoint tensor name -> engine slot.

A table is data, not code: supporting another MoE family (issue 8) means adding a table and,
where the math differs, a flag on ModelSpec. Slots:
  global: embed, final_norm, lm_head
  layer:  input_norm, post_norm, q, k, v, o, router
  expert: w1 (gate), w3 (up), w2 (down), one tensor per expert
  fused:  gate_up [E, 2*I, H] and down [E, H, I], the layout transformers 5 uses in memory
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class NameMatch:
    """Where a checkpoint tensor goes: `scope` is global/layer/expert/fused."""

    scope: str
    slot: str
    layer: Optional[int] = None
    expert: Optional[int] = None


_L = r"model\.layers\.(?P<layer>\d+)\."
_E = r"(?P<expert>\d+)"

# Mixtral: legacy hub names (block_sparse_moe.experts.E.w1) and the transformers 5 in-memory
# names (mlp.experts.gate_up_proj), so both kinds of saved checkpoints load.
MIXTRAL_TABLE: tuple[tuple[str, str, str], ...] = (
    (r"model\.embed_tokens\.weight", "global", "embed"),
    (r"model\.norm\.weight", "global", "final_norm"),
    (r"lm_head\.weight", "global", "lm_head"),
    (_L + r"input_layernorm\.weight", "layer", "input_norm"),
    (_L + r"post_attention_layernorm\.weight", "layer", "post_norm"),
    (_L + r"self_attn\.q_proj\.weight", "layer", "q"),
    (_L + r"self_attn\.k_proj\.weight", "layer", "k"),
    (_L + r"self_attn\.v_proj\.weight", "layer", "v"),
    (_L + r"self_attn\.o_proj\.weight", "layer", "o"),
    (_L + r"(?:block_sparse_moe|mlp)\.gate\.weight", "layer", "router"),
    (_L + r"block_sparse_moe\.experts\." + _E + r"\.w1\.weight", "expert", "w1"),
    (_L + r"block_sparse_moe\.experts\." + _E + r"\.w2\.weight", "expert", "w2"),
    (_L + r"block_sparse_moe\.experts\." + _E + r"\.w3\.weight", "expert", "w3"),
    (_L + r"(?:block_sparse_moe|mlp)\.experts\.gate_up_proj", "fused", "gate_up"),
    (_L + r"(?:block_sparse_moe|mlp)\.experts\.down_proj", "fused", "down"),
)

ARCH_TABLES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "MixtralForCausalLM": MIXTRAL_TABLE,
}


class NameTable:
    """Compiled name table of one architecture."""

    def __init__(self, architecture: str):
        if architecture not in ARCH_TABLES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {sorted(ARCH_TABLES)}")
        self.architecture = architecture
        self._rules = [(re.compile(p + r"$"), scope, slot)
                       for p, scope, slot in ARCH_TABLES[architecture]]

    def match(self, name: str) -> Optional[NameMatch]:
        """Map a checkpoint tensor name to its slot, or None for tensors the engine ignores."""
        for rx, scope, slot in self._rules:
            m = rx.match(name)
            if m:
                groups = m.groupdict()
                layer = int(groups["layer"]) if groups.get("layer") is not None else None
                expert = int(groups["expert"]) if groups.get("expert") is not None else None
                return NameMatch(scope, slot, layer, expert)
        return None
