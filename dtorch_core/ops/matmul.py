"""Contractions: mm, bmm, addmm, baddbmm (matmul/linear/einsum decompose into these)."""

from __future__ import annotations

import torch

from ..placement import Shard
from .common import LINEAR_PARTIALS, R
from ..planner.schema import Strategy

aten = torch.ops.aten


def contraction(product_labels: tuple[str, ...], out_labels: str, additive: int = 0):
    """Rule for an einsum-like product; the first ``additive`` inputs are added to the product
    (broadcast against the output, right-aligned), like the bias of addmm."""

    def strategies(call):
        n_in = len(call.inputs)
        adds = call.inputs[:additive]
        out_shape = tuple(call.outputs[0].shape)

        def add_placement(t, label):
            if label not in out_labels:
                return R
            od = out_labels.index(label)
            td = od - (len(out_labels) - t.ndim)
            return Shard(td) if td >= 0 and t.shape[td] == out_shape[od] else R

        result = [Strategy((R,) * n_in, (R,))]
        labels = dict.fromkeys("".join(product_labels))
        for label in labels:
            prod = tuple(Shard(ls.index(label)) if label in ls else R for ls in product_labels)
            if label in out_labels:
                adds_p = tuple(add_placement(t, label) for t in adds)
                result.append(Strategy(adds_p + prod, (Shard(out_labels.index(label)),)))
            else:
                for p in LINEAR_PARTIALS[:1]:
                    result.append(Strategy((p,) * additive + prod, (p,)))
        for i in range(len(product_labels)):
            for p in LINEAR_PARTIALS:
                prod = tuple(p if j == i else R for j in range(len(product_labels)))
                result.append(Strategy((p,) * additive + prod, (p,)))
        return result

    return strategies


def register(registry) -> None:
    registry.add(aten.mm.default, contraction(("mk", "kn"), "mn"))
    registry.add(aten.bmm.default, contraction(("bmk", "bkn"), "bmn"))
    registry.add(aten.addmm.default, contraction(("mk", "kn"), "mn", additive=1))
    registry.add(aten.baddbmm.default, contraction(("bmk", "bkn"), "bmn", additive=1))
    registry.add(aten.dot.default, contraction(("k", "k"), ""))
    registry.add(aten.mv.default, contraction(("mk", "k"), "m"))
