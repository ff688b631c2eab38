"""ND-parallel training of a tiny causal LM with Hugging Face Accelerate's ``ParallelismConfig``:
HSDP (``dp_replicate`` x ``dp_shard``, FSDP2) x tensor parallelism, the loss averaged over the
data dimensions, sharded ``save_state`` every ``--checkpoint-frequency`` steps.

Written as Accelerate's examples/torch_native_parallelism/nd_parallel.py, with a causal LM built
here (no hub download) that carries its tensor-parallel plan in ``tp_plan`` and fixed synthetic
token data, so that it runs on CPU (gloo) in seconds:

    accelerate launch --cpu --num_processes 8 nd_parallel_accelerate.py \
        --dp-replicate-size 2 --dp-shard-size 2 --tp-size 2

Accelerate applies no tensor-parallel plan itself (it expects a model that transformers'
``from_pretrained(tp_plan="auto")`` already split), so the script does what transformers does:
``parallelize_module`` over ``torch_device_mesh["tp"]`` with the model's plan, and records
``model.tp_size``. The global batch is ``--global-batch-size`` whatever the layout, so every
layout trains on the same batches and reaches the same losses (up to rounding).
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from accelerate.utils import set_seed
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 64, 64, 4, 128, 2


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--global-batch-size", type=int, default=8, help="sequences per step, all ranks together")
    parser.add_argument("--num-steps", type=int, default=12)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


class RMSNorm(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        head_dim = HIDDEN // HEADS
        # -1 heads: under tensor parallelism a process holds HEADS / tp_size of them
        q, k, v = (proj(x).view(b, s, -1, head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.self_attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Output(dict):
    __getattr__ = dict.__getitem__


class TinyCausalLM(torch.nn.Module):
    """A Llama-shaped causal LM (parameter-free RMSNorm), with transformers' plan names."""

    tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels=None, shift_labels=None, position_ids=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        target = shift_labels if shift_labels is not None else labels
        loss = None if target is None else F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        return Output(loss=loss, logits=logits)


def get_dataset(seq_len, rows):
    """Fixed synthetic token streams: t -> (5 t + 3) mod VOCAB from a random first token, 10% of
    the tokens replaced by noise."""
    generator = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(rows):
        tokens = [int(torch.randint(0, VOCAB, (1,), generator=generator))]
        for _ in range(seq_len):
            tokens.append((5 * tokens[-1] + 3) % VOCAB)
        noise = torch.rand(seq_len + 1, generator=generator) < 0.1
        tokens = torch.where(noise, torch.randint(0, VOCAB, (seq_len + 1,), generator=generator), torch.tensor(tokens))
        data.append({"input_ids": tokens[:-1].tolist(), "shift_labels": tokens[1:].tolist()})
    return data


def create_collate_fn():
    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    # the loss averaged over the processes that hold different batches (the data dimensions)
    loss_reduce_grp = (
        accelerator.torch_device_mesh["dp_cp"].get_group()
        if accelerator.parallelism_config.dp_cp_dim_names
        else None
    )
    outputs = model(**batch)
    loss = outputs.loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    loss = loss.detach()
    if accelerator.num_processes > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=loss_reduce_grp)  # gloo has no ReduceOp.AVG
        loss = loss / dist.get_world_size(loss_reduce_grp)
    return loss


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
    )

    # FSDP needs extra configuration, so we properly shard the model
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["DecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )

    accelerator = Accelerator(parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin)
    accelerator.print(f"processes={accelerator.num_processes} mesh={accelerator.torch_device_mesh}")

    set_seed(42)
    model = TinyCausalLM()
    if args.tp_size > 1:  # what from_pretrained(tp_plan="auto", device_mesh=...) does for transformers' models
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, accelerator.torch_device_mesh["tp"],
                           {name: styles[style]() for name, style in model.tp_plan.items()})
        model.tp_size = args.tp_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = get_dataset(args.sequence_length, args.num_steps * args.global_batch_size)
    batch_size = args.global_batch_size // parallelism_config.data_parallel_size  # per data-parallel rank
    dataloader = DataLoader(dataset, batch_size=batch_size, collate_fn=create_collate_fn())

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    accelerator.print("Starting training...")
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break

        loss = forward(model, batch, optimizer, accelerator)
        accelerator.print(f"Step {step}/{total_num_steps}, Loss: {loss.item():.6f}")

        if step % args.checkpoint_frequency == 0 and step > 0 and parallelism_config.dp_shard_enabled:
            accelerator.print(f"Saving checkpoint at step {step}...")
            accelerator.save_state(os.path.join(args.save_dir, f"checkpoint-{step}"))

        accelerator.log({"loss": loss.item()})

    accelerator.print("Training completed!")
    accelerator.end_training()


if __name__ == "__main__":
    set_seed(42)
    args = parse_args()
    if args.dp_shard_size == 1 and args.tp_size > 1:
        warnings.warn("Accelerator.save_state() is not yet supported with pure tensor parallel training. Training "
                      "will work, but intermediate checkpoints will not be saved.", stacklevel=1)
    train(args)
