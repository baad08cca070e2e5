"""A reference trainer: a real policy-gradient loop (torch on CPU) on the tiny model, through the product only.

    .venv-vllm/bin/python examples/train_reinforce.py --url http://127.0.0.1:8000 --token $ROLLOUTCTL_TOKEN \
        --vllm-url http://127.0.0.1:8011 --steps 30

Each step: a collection job on the current weights (one per weight version; its Idempotency-Key names the run
and the step, so a restarted trainer finds it again), its complete groups taken from the rollout stream
(rolloutctl.stream, a named consumer), a group-relative REINFORCE loss on the sampled tokens' log-probs under the
torch model, one optimizer step, a checkpoint (safetensors, the served model's layout), and the weight update
POSTed to the product (`/api/endpoints/<id>/weights/?wait=`), which pauses vLLM, reloads the checkpoint and
resumes it; the next step's job samples from the new weights. Reward: examples.train_reward:digit_fraction
(the web server and workers need VERIFIER_PATH_MODULES=examples.train_reward).

The log-probs are of exactly the tokens vLLM sampled: the jobs ask vLLM for them (`return_token_ids` in
extra_body) and the product keeps them on the response's message (`prompt_token_ids`, `generation_token_ids`);
with a server that gives none, the completion's text is retokenized, which often differs (byte pieces decode to
U+FFFD).

Exactly once across restarts: a batch is acknowledged only once its rollouts are in the run's stash on disk
(deduplicated by id), the stash is emptied when the step's checkpoint is saved, and the trainer resumes from
its state file (--out): a trainer killed anywhere trains on every rollout once. Per step it prints the version
the rollouts came from, how many, their mean reward and the time spent waiting for rollouts / training (loss and
optimizer step) / saving the checkpoint / updating the weights, and it appends the same (plus the rollout ids,
lags and versions) to <out>/steps.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # rolloutctl, when run as a script from anywhere

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rolloutctl.client import Client  # noqa: E402
from rolloutctl.stream import RolloutStream  # noqa: E402

REWARD = "examples.train_reward:digit_fraction"
PROMPTS = ["Write a number.", "Count to ten.", "What is 17 + 25?", "Say something.", "Name a year.",
           "How many apples?", "Give me a price.", "What time is it?"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("ROLLOUTCTL_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token", default=os.environ.get("ROLLOUTCTL_TOKEN"))
    p.add_argument("--vllm-url", required=True, help="the vLLM server the endpoint points at (as the workers see it)")
    p.add_argument("--model-dir", default=str(ROOT / "var" / "tiny-model"), help="the weights vLLM started with")
    p.add_argument("--out", default=str(ROOT / "var" / "train-run"), help="checkpoints, state and steps.jsonl")
    p.add_argument("--run", default="reinforce", help="run name: the stream consumer and the jobs' idempotency keys")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8, help="tasks per step (groups)")
    p.add_argument("--group", type=int, default=8, help="samples per task (num_repeats)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: a tiny model steps fastest alone, beside vLLM and the workers)")
    p.add_argument("--max-lag", type=int, default=0, help="the jobs' max_version_lag (stale ones are recollected)")
    p.add_argument("--crash-after-take", type=int, default=0,
                   help="fault injection for tests: exit(3) right after the stream hands out step N's first batch")
    return p.parse_args(argv)


# --- the product: dataset, endpoint, one job per version, the stream, the weight update --------------------
class Product:
    def __init__(self, args):
        self.args = args
        self.client = Client(args.url, args.token, timeout_s=120)

    def dataset(self, out: Path) -> int:
        path = out / "prompts.jsonl"
        with open(path, "w") as f:
            for text in PROMPTS[: self.args.prompts]:
                f.write(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": text}]}}) + "\n")
        import hashlib
        found = self.client.find_dataset(hashlib.sha256(path.read_bytes()).hexdigest())
        return (found or self.client.upload_dataset(str(path), name=f"{self.args.run}-prompts"))["id"]

    def endpoint(self) -> int:
        ep, _ = self.client.find_or_create_endpoint(base_url=self.args.vllm_url, model="tiny")
        return ep["id"]

    def job(self, step: int, dataset: int, endpoint: int) -> int:
        a = self.args
        body = {"name": f"{a.run} step {step}", "dataset": dataset, "endpoint": endpoint, "num_repeats": a.group,
                "num_samples_in_parallel": a.prompts * a.group, "verifier": REWARD,
                "responses_create_params": {"max_output_tokens": a.max_tokens, "temperature": 1.0,
                                            # vLLM answers the token ids it read and sampled; stored on the message
                                            "metadata": {"extra_body": json.dumps({"return_token_ids": True})}},
                "max_version_lag": a.max_lag, "stale_policy": "recollect"}
        job, _ = self.client.create_job(body, idempotency_key=f"{a.run}-step-{step}")
        return job["id"]

    def update(self, endpoint: int, path: Path) -> dict:
        """POST the update (queued on the control lane) and wait for its end: ?wait= answers when it ended
        (up to 60 s), else the action's Location is read again until it has."""
        resp = self.client.request("POST", f"endpoints/{endpoint}/weights/", params={"wait": 60}, retry=False,
                                   json={"path": str(path), "checkpoint_id": path.name},
                                   expect=(200, 202))
        body, where = resp.json(), resp.headers.get("Location") or ""
        where = where.split("/api/", 1)[-1]  # the client's paths are under its /api base
        deadline = time.monotonic() + 600
        while body.get("state") not in ("succeeded", "failed", "cancelled") and where and time.monotonic() < deadline:
            time.sleep(0.2)
            body = self.client.get_json(where)
        return body


def message_item(response: dict) -> dict:
    return next((i for i in (response or {}).get("output") or [] if i.get("type") == "message"), {})


def response_text(response: dict) -> str:
    return "".join(c.get("text", "") for item in (response or {}).get("output") or [] if item.get("type") == "message"
                   for c in item.get("content") or [] if c.get("type") == "output_text")


# --- the policy ------------------------------------------------------------------------------------------
class Policy:
    def __init__(self, model_dir: Path, lr: float, threads: int = 1):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.set_num_threads(max(1, threads))
        torch.manual_seed(0)
        self.torch = torch
        self.base = Path(model_dir).resolve()
        self.tok = AutoTokenizer.from_pretrained(self.base)
        self.model = LlamaForCausalLM.from_pretrained(self.base, torch_dtype=torch.float32)
        self.served = {k: v.dtype for k, v in load_file(self.base / "model.safetensors").items()}
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)

    def load(self, ckpt: Path) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict({k: v.float() for k, v in load_file(ckpt / "model.safetensors").items()},
                                   strict=False)
        opt = ckpt / "optimizer.pt"
        if opt.exists():
            self.opt.load_state_dict(self.torch.load(opt))

    def step(self, groups: list[list[dict]]) -> dict:
        """One REINFORCE step, group-relative advantages (reward - the group's mean, over its std): the loss is
        -sum(A * log p(sampled tokens)) / tokens, the log-probs of the retokenized completions under this model."""
        torch = self.torch
        seqs, advs, starts = [], [], []
        sampled = 0  # rollouts scored on the token ids vLLM sampled
        for g in groups:
            r = torch.tensor([float(x["reward"] or 0.0) for x in g])
            a = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
            for x, adv in zip(g, a.tolist()):
                data = x["data"]
                item = message_item(data.get("response"))
                if item.get("generation_token_ids") is not None:  # exactly what vLLM read and sampled
                    prompt, completion = item["prompt_token_ids"], item["generation_token_ids"]
                    sampled += 1
                else:  # a server without token ids: the text retokenized (not always the sampled tokens)
                    msgs = data["responses_create_params"]["input"]
                    prompt = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                    if hasattr(prompt, "keys"):  # transformers 5 answers a BatchEncoding
                        prompt = prompt["input_ids"]
                    completion = self.tok.encode(response_text(data.get("response")), add_special_tokens=False)
                if not completion:
                    continue
                seqs.append(list(prompt) + completion)
                starts.append(len(prompt))
                advs.append(adv)
        if not seqs:
            return {"loss": 0.0, "tokens": 0, "sampled_ids": sampled}
        width = max(map(len, seqs))
        pad = self.tok.pad_token_id or 0
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        mask = torch.zeros(len(seqs), width - 1)
        for i, (s, st) in enumerate(zip(seqs, starts)):
            mask[i, st - 1: len(s) - 1] = 1.0  # the positions predicting the completion's tokens
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(torch.tensor(advs)[:, None] * logp * mask).sum() / mask.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return {"loss": float(loss.detach()), "tokens": int(mask.sum()), "sampled_ids": sampled}

    def save(self, ckpt: Path) -> None:
        """The served model's files with this model's weights (in the served dtypes), then the optimizer."""
        from safetensors.torch import save_file

        tmp = ckpt.with_name(ckpt.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.base, tmp, ignore=shutil.ignore_patterns(".*"))
        state = self.model.state_dict()
        save_file({k: state[k].detach().to(dt).contiguous() for k, dt in self.served.items()},
                  tmp / "model.safetensors", metadata={"format": "pt"})
        self.torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)


# --- the loop --------------------------------------------------------------------------------------------
def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # atomic: a crash leaves the old file or the new one


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    state_path, stash_path = out / "state.json", out / "stash.json"
    # a fresh run first serves its starting weights (vLLM may serve an earlier run's): checkpoint = the base model
    state = (json.loads(state_path.read_text()) if state_path.exists()
             else {"step": 1, "version": None, "updated": False, "checkpoint": str(Path(args.model_dir).resolve())})
    product = Product(args)
    policy = Policy(Path(args.model_dir), args.lr, args.threads)
    dataset, endpoint = product.dataset(out), product.endpoint()
    if state["step"] > 1:
        policy.load(Path(state["checkpoint"]))
    print(f"run {args.run}: endpoint {endpoint}, dataset {dataset}, {args.prompts} tasks x {args.group} samples a step, "
          f"resuming at step {state['step']}", flush=True)
    print("step version rollouts mean_reward  wait_s train_s  ckpt_s update_s  loss", flush=True)
    while state["step"] <= args.steps:
        step = state["step"]
        if not state["updated"]:  # the starting weights, or killed after the checkpoint before its update ended
            state.update(version=int(apply_update(product, endpoint, Path(state["checkpoint"]))["version"]),
                         updated=True)
            write_json(state_path, state)
        job = product.job(step, dataset, endpoint)
        stream = RolloutStream(args.url, args.token, job=job, consumer=args.run, max=args.prompts * args.group,
                               wait=10, groups=True, client=product.client)
        stash = json.loads(stash_path.read_text()) if stash_path.exists() else {"step": step, "rows": {}}
        if stash["step"] != step:
            stash = {"step": step, "rows": {}}
        redelivered = 0
        t0 = time.monotonic()
        while len(stash["rows"]) < args.prompts * args.group:
            batch = stream.take()
            if batch is None:
                if product.client.job(job)["state"] in ("completed", "failed", "cancelled"):
                    batch = stream.take(wait=0)
                    if batch is None:
                        break
                else:
                    continue
            if args.crash_after_take == step and not batch.redelivered:
                print(f"crash: exiting with step {step}'s batch {batch.token} taken, not acknowledged", flush=True)
                os._exit(3)
            redelivered += batch.redelivered
            for r in batch.rollouts:
                stash["rows"].setdefault(str(r["id"]), r)  # a batch redelivered after a crash: once
            write_json(stash_path, stash)
            stream.ack(batch)
        wait_s = time.monotonic() - t0
        rows = sorted(stash["rows"].values(), key=lambda r: (r["task_index"], r["rollout_index"]))
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault((r["task_index"], r["rollout_index"] // args.group), []).append(r)
        t1 = time.monotonic()
        stats = policy.step(list(groups.values()))
        train_s = time.monotonic() - t1
        ckpt = out / f"step-{step:04d}"
        policy.save(ckpt)
        ckpt_s = time.monotonic() - t1 - train_s
        rewards = [float(r["reward"] or 0.0) for r in rows]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        versions = sorted({r["weight_version"] for r in rows})
        record = {"step": step, "job": job, "version": state["version"], "rollouts": len(rows), "groups": len(groups),
                  "mean_reward": mean, "loss": stats["loss"], "tokens": stats["tokens"], "sampled_ids": stats["sampled_ids"], "wait_s": wait_s,
                  "train_s": train_s, "checkpoint_s": ckpt_s, "redelivered": redelivered, "ids": [r["id"] for r in rows],
                  "group_sizes": [len(g) for g in groups.values()], "lags": [r.get("lag") for r in rows],
                  "weight_versions": versions}
        state = {"step": step + 1, "version": state["version"], "updated": False, "checkpoint": str(ckpt)}
        write_json(state_path, state)  # the step is done: its rollouts count as trained on
        stash_path.unlink(missing_ok=True)
        t2 = time.monotonic()
        result = apply_update(product, endpoint, ckpt)
        record["update_s"] = time.monotonic() - t2
        record["next_version"] = state["version"] = int(result["version"])
        state["updated"] = True
        write_json(state_path, state)
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{step:4d} {record['version']:7d} {len(rows):8d} {mean:11.4f} {wait_s:7.2f} {train_s:7.2f} {ckpt_s:7.2f} "
              f"{record['update_s']:8.2f}  {stats['loss']:+.4f}", flush=True)
    return 0


def apply_update(product: Product, endpoint: int, ckpt: Path) -> dict:
    """POST the weight update (the control plane numbers it: the last version + 1) and wait for its end."""
    body = product.update(endpoint, ckpt)
    if body.get("state") != "succeeded":
        raise SystemExit(f"the weight update to {ckpt} did not succeed: {json.dumps(body)[:2000]}")
    return body["result"]


if __name__ == "__main__":
    sys.exit(main())
