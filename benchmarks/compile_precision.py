"""How compiled decoder layers round in bf16, against eager layers and an fp32 model.

    python3 benchmarks/compile_precision.py [--device cuda] --json-out FILE.json

One model with random weights, in fp32 (the reference) and in bf16 copies: decoder layers
eager, twice (the second run shows the eager kernels' own run-to-run spread: none on CPU, the
atomics of some backward kernels on a GPU); compiled by Inductor as the trainer compiles them
(`compile_model`); compiled with Inductor's `emulate_precision_casts`, which rounds each fused
op's output to bf16 where eager rounds it. Inductor otherwise keeps a fused kernel's
intermediates in fp32, so compiled layers round differently from eager ones. Each copy runs
forward + backward on `--packs` random packs; reported per copy, as the mean and max over
packs: the summed loss's relative error and the decoder weights' gradients' relative error
(norm of the difference over the norm, the worst weight of a pack), against the fp32 model and
against the first eager bf16 run.

Inductor compiles C++ on CPU and Triton on GPUs; its rounding policy is the same for both. The
fp32 model's attention is the masked path (the varlen kernels take bf16 only), so on a GPU
keep --rows to a few thousand.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch
from common import log, machine_info, parser, register_fewer_layers, write_json

from train.model.arch import builtin_arch
from train.model.batch import PackedBatch
from train.model.qwen_vl import compile_model, transformer_config
from train.parallel import build_model, destroy_parallel, init_parallel

# copy -> the Inductor settings it compiles under (None: eager), explicit so that the
# environment (TORCHINDUCTOR_EMULATE_PRECISION_CASTS) cannot blur the two compiled copies
COPIES = {"eager": None, "eager, again": None, "compiled": {"emulate_precision_casts": False},
          "compiled, emulated casts": {"emulate_precision_casts": True}}


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--arch", default="tiny", help="built-in architecture (default %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="cut the architecture to this many decoder layers")
    ap.add_argument("--packs", type=int, default=8, help="random packs (default %(default)s)")
    ap.add_argument("--rows", type=int, default=256, help="rows per pack (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the packs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the copies run (default %(default)s)")
    return ap.parse_args(argv)


def document_bounds(rng: np.random.Generator, rows: int, tokens: tuple[int, int]) -> list[int]:
    """cu_seqlens of one pack: documents of `tokens` lengths until `rows` are filled."""
    bounds = [0]
    while bounds[-1] < rows:
        bounds.append(min(rows, bounds[-1] + int(rng.integers(tokens[0], tokens[1] + 1))))
    return bounds


def random_pack(rng: np.random.Generator, rows: int, vocab: int):
    """Token ids, positions, cu_seqlens, longest document and labels (30 % without a target) of
    a pack of documents of rows/8 to rows/2 tokens."""
    cu = torch.tensor(document_bounds(rng, rows, (rows // 8, rows // 2)))
    ids = torch.from_numpy(rng.integers(0, vocab, rows))
    labels = torch.where(torch.from_numpy(rng.random(rows) < 0.3), -100, ids)
    positions = (torch.arange(rows) - torch.repeat_interleave(cu[:-1], cu.diff()))[None].expand(3, rows).contiguous()
    return ids, positions, cu, int(cu.diff().max()), labels


def loss_and_grads(model, pack) -> tuple[float, dict[str, torch.Tensor]]:
    ids, positions, cu, longest, labels = pack
    device = next(model.parameters()).device
    ids, positions, cu, labels = (t.to(device) for t in (ids, positions, cu, labels))
    model.zero_grad(set_to_none=True)
    loss = model(PackedBatch.from_segments(ids, positions, cu, labels)).sum()
    loss.backward()
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None and ".decoder." in n}


def rel_errors(run, reference) -> tuple[float, float]:
    (loss, grads), (ref_loss, ref_grads) = run, reference
    return (abs(loss - ref_loss) / abs(ref_loss),
            max(((grads[n].float() - g.float()).norm() / g.float().norm().clamp(min=1e-30)).item()
                for n, g in ref_grads.items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch._inductor.config as inductor

    cpu = args.device == "cpu"
    arch = builtin_arch(args.arch if args.layers is None else register_fewer_layers(args.arch, args.layers))
    info = init_parallel(1, 1, device=args.device, seed=args.seed)
    torch.manual_seed(args.seed)
    reference = build_model(arch, transformer_config(arch, cpu=cpu), info)
    for p in reference.parameters():  # norms' gains near 1, everything else small
        p.data.normal_(0, 0.05).add_(1 if p.ndim == 1 else 0)
    weights = reference.state_dict()
    rng = np.random.default_rng(args.seed)
    packs = [random_pack(rng, args.rows, arch.lm.vocab_size) for _ in range(args.packs)]
    fp32 = [loss_and_grads(reference, pack) for pack in packs]
    del reference

    runs = {}
    for copy, settings in COPIES.items():
        torch._dynamo.reset()  # a compiled copy compiles afresh, under its own settings
        model = build_model(arch, transformer_config(arch, cpu=cpu, params_dtype=torch.bfloat16, bf16=True), info)
        model.load_state_dict({k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                               for k, v in weights.items()})
        with inductor.patch(settings or {}):  # compiles on the first pack, so inside
            if settings is not None:
                compile_model(model, decoder=True)
            runs[copy] = [loss_and_grads(model, pack) for pack in packs]
        del model
        log(f"{copy}: {args.packs} packs")

    result = {"machine": machine_info(args.device), "args": vars(args), "copies": {}}
    print(f"{args.arch}, {arch.lm.num_layers} decoder layers, bf16 copies against the fp32 model and the eager "
          f"copy, {args.packs} packs of {args.rows} rows (mean / max over packs)")
    for copy, run in runs.items():
        row = {}
        for against, ref in (("fp32", fp32), ("eager", runs["eager"])):
            errors = [rel_errors(r, f) for r, f in zip(run, ref)]
            row[against] = {"loss_mean": statistics.mean(e[0] for e in errors), "loss_max": max(e[0] for e in errors),
                            "grad_mean": statistics.mean(e[1] for e in errors), "grad_max": max(e[1] for e in errors)}
        result["copies"][copy] = row
        print(f"  {copy:>26}: vs fp32 loss {row['fp32']['loss_mean']:.2e} / {row['fp32']['loss_max']:.2e}, "
              f"gradients {row['fp32']['grad_mean']:.2e} / {row['fp32']['grad_max']:.2e}; vs eager loss "
              f"{row['eager']['loss_mean']:.2e} / {row['eager']['loss_max']:.2e}, gradients "
              f"{row['eager']['grad_mean']:.2e} / {row['eager']['grad_max']:.2e}")
    if args.json_out:
        write_json(args.json_out, result)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
