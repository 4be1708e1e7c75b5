"""One rank of the tensor-parallel test: python _tp_worker.py MODEL_DIR RANK WORLD PORT OUT."""

from __future__ import annotations

import sys

from _harness import configure_env

configure_env()

import torch  # noqa: E402


def main() -> None:
    model_dir, rank, world, port, out = sys.argv[1:6]
    rank, world = int(rank), int(world)
    import embedq.backends.vllm as ev
    ev.register()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    from _harness import engine_config, vocab_layers, without_missing_cpu_kernels
    without_missing_cpu_kernels()

    vc = engine_config(model_dir, tp=world)
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(world, 1)
        model = get_model(vllm_config=vc)
        embed, head = vocab_layers(model)
        ids = torch.arange(0, model.config.vocab_size).flip(0)
        g = torch.Generator().manual_seed(2)
        h = torch.randn(5, model.config.hidden_size, generator=g).to(torch.bfloat16)
        result = {
            "rank": rank,
            "tp_size": embed.tp_size,
            "shard": (embed.shard_indices.org_vocab_start_index,
                      embed.shard_indices.org_vocab_end_index),
            "params": {n: p.detach().clone() for n, p in embed.named_parameters()},
            "head_shares": (head.weight_packed is embed.weight_packed
                            and head.embedq_prepared is embed.embedq_prepared),
            "prepared_rows": embed.embedq_prepared.rows,
            "prepared_bytes": embed.embedq_prepared.nbytes,
            "prepared_kind": embed.embedq_prepared.kind,
            "table": embed.quant_method.dequantize_weight(embed, torch.bfloat16),
            "embeddings": embed(ids),
            "logits": model.compute_logits(h),
            "h": h,
        }
    torch.save(result, out)


if __name__ == "__main__":
    main()
