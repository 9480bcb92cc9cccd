"""Write the ShareGPT conversations a `flotilla bench serve --dataset-name sharegpt` run
would pick (same seed, same tokenizer, same length filter) as a small ShareGPT file, so a
GPU machine gets the same requests without the 27 MB dataset wheel:

    python -m benchmarks.gpu.sharegpt_subset --num-prompts 1000 --tokenizer DIR --out FILE

On that file the bench shuffles again, so it sends the same requests in another order.
"""

from __future__ import annotations

import argparse
import json
import random

from transformers import AutoTokenizer

from cli.bench import sharegpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    exchanges = sharegpt.load_exchanges(sharegpt.default_path())
    order = list(range(len(exchanges)))
    random.Random(args.seed).shuffle(order)
    chosen = []
    for i in order:  # the selection sharegpt_requests makes
        if len(chosen) == args.num_prompts:
            break
        prompt, reply = exchanges[i]
        if sharegpt.is_valid_pair(len(tokenizer.encode(prompt, add_special_tokens=False)),
                                  len(tokenizer.encode(reply, add_special_tokens=False))):
            chosen.append({"conversations": [{"from": "human", "value": prompt},
                                             {"from": "gpt", "value": reply}]})
    with open(args.out, "w") as out:
        json.dump(chosen, out, ensure_ascii=False)
    print(f"{len(chosen)} conversations -> {args.out}")


if __name__ == "__main__":
    main()
