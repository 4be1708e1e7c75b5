"""``embedq eval`` (KLD of an overlay) and ``embedq plan`` (KV-cache capacity)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from embedq.cli.common import fail, run
from embedq.format.constants import SUPPORTED_BITS


def register(app: typer.Typer) -> None:
    from embedq.errors import EmbedqError

    @app.command("eval")
    def eval_(
        model: Path = typer.Argument(..., help="Checkpoint with an embedq overlay (in place or derived)"),
        text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file (default: Python's "
                                            "pydoc_data/topics.py)"),
        contexts: int = typer.Option(12, "--contexts", help="Number of contexts"),
        length: int = typer.Option(128, "--length", help="Tokens per context, BOS included"),
        reference: Optional[Path] = typer.Option(None, "--reference", help="Float checkpoint to compare "
                                                 "against (default: MODEL's own float shards)"),
        dtype: str = typer.Option("float32", "--dtype", help="Compute dtype: float32, bfloat16, float16"),
        float_head: bool = typer.Option(False, "--float-head", help="Keep the head float (measure the "
                                        "gather only)"),
        activations: Optional[str] = typer.Option(None, "--activations", help="exact, or int8: 4-bit heads "
                                                  "with int8 activations, the serving opt-in (default: "
                                                  "EMBEDQ_ACTIVATIONS, else exact)"),
        seed: int = typer.Option(0, "--seed", help="Bootstrap seed"),
        floor: Optional[bool] = typer.Option(None, "--floor/--no-floor", help="Also measure the float model "
                                             "run in bf16: the noise floor (default: for a bf16 model)"),
        device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:1, ... (default: CPU)"),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar"),
    ) -> None:
        """KLD of MODEL's overlay against the float model: mean, percentiles, top-1, Δppl, 95% CI."""
        from embedq.quality.evaluate import evaluate
        r = run(evaluate, model, text=text, contexts=contexts, length=length, reference=reference,
                 dtype=dtype, float_head=float_head, seed=seed, progress=not (quiet or as_json),
                 device=device, floor=floor, activations=activations)
        typer.echo(r.to_json() if as_json else r.table())

    @app.command("plan")
    def plan_(
        model: str = typer.Argument(..., help="Checkpoint folder (with or without an overlay), a folder "
                                    "with only config.json (+ --weights-gib), or a Hub org/model id"),
        gpu_mem: str = typer.Option("32GiB", "--gpu-mem", help="GPU memory: 32GiB, 24GB (10^9), 80G"),
        kv_dtype: str = typer.Option("auto", "--kv-dtype", help="fp8, bf16, fp16 or auto (model dtype)"),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                    help="Default: max_position_embeddings"),
        utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="vLLM's fraction"),
        reserve: Optional[str] = typer.Option(None, "--reserve", help="Activation + non-torch reserve "
                                              "(default: estimated, CUDA graphs not counted: vLLM "
                                              "subtracts them by default; e.g. 2GiB)"),
        batched: int = typer.Option(8192, "--max-num-batched-tokens"),
        max_seqs: int = typer.Option(256, "--max-num-seqs"),
        weights_gib: Optional[str] = typer.Option(None, "--weights-gib", help="Float weight size (GiB, or "
                                                  "24GB, 900MiB): plan from config.json alone"),
        revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag, commit)"),
        block_size: Optional[int] = typer.Option(None, "--block-size", help="vLLM --block-size (default 16)"),
        prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                            help="vLLM's prefix caching (on by default; hybrid models "
                                            "keep 2 state pages per request with it, 1 without)"),
        async_scheduling: bool = typer.Option(True, "--async-scheduling/--no-async-scheduling",
                                              help="vLLM's async scheduling (2 batches in flight)"),
        gdn_checkpoints: bool = typer.Option(False, "--gdn-checkpoints", help="FlashInfer gated-delta-net "
                                             "prefill (Hopper/Blackwell): +1 state page, 64-token blocks"),
        ssm_dtype: str = typer.Option("auto", "--mamba-ssm-cache-dtype", help="vLLM's flag: auto "
                                      "(config's mamba_ssm_dtype for Qwen3.5, else model dtype), "
                                      "bfloat16, float16, float32"),
        bits: Optional[int] = typer.Option(None, "--bits", help="Without an overlay: the scheme to estimate "
                                           "(default: embedq quantize's)"),
        group_size: Optional[int] = typer.Option(None, "--group-size"),
        asym: Optional[bool] = typer.Option(None, "--asym/--sym"),
        as_json: bool = typer.Option(False, "--json", help="Print the plan (and vLLM's numbers) as JSON"),
    ) -> None:
        """KV-cache tokens that fit on a GPU with float tables vs the overlay (vLLM 0.33.0's rules)."""
        from embedq.capacity.plan import plan
        if bits is not None and bits not in SUPPORTED_BITS:
            fail(EmbedqError(f"--bits {bits}: choose {' or '.join(map(str, SUPPORTED_BITS))}"))
        r = run(plan, model, gpu_mem, kv_dtype=kv_dtype, max_model_len=max_model_len,
                 gpu_memory_utilization=utilization, reserve=reserve, max_num_batched_tokens=batched,
                 max_num_seqs=max_seqs, bits=bits, group_size=group_size, symmetric=None if asym is None else not asym,
                 weights_gib=weights_gib, revision=revision, block_size=block_size,
                 prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                 gdn_checkpoints=gdn_checkpoints, mamba_ssm_cache_dtype=ssm_dtype)
        typer.echo(r.to_json() if as_json else r.table())
