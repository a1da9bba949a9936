"""Train nncanon's demo models: small causal LMs that know a few hundred plain facts.

Random weights answer nothing, so ``nncanon.demo_model(name)`` ships trained ones. This script
writes everything they are made of, from the fact tables below:

* ``src/nncanon/demo/corpus.txt``: the corpus, plain factual sentences, several templates per fact;
* a byte-level BPE tokenizer trained on it (every one-word answer, `` Paris`` first, is one token; a
  multi-word answer such as `` New York`` is scored on its first token);
* three small causal LMs trained on it, each in ``src/nncanon/demo/<name>/`` with the tokenizer files:
  ``gpt2`` (GPT2LMHeadModel), ``llama`` (LlamaForCausalLM, grouped-query attention) and ``hybrid``
  (Qwen3NextForCausalLM: three gated-DeltaNet layers and one full-attention layer, a tiny MoE:
  four experts, two per token, and a shared expert).

Everything runs on the CPU from a fixed seed, one thread by default (the results depend on the thread
count only through float rounding). A model is trained in epochs until it has learned its facts (top-1
on at least ``--accuracy`` of the prompts whose answer the corpus fixes, and P(" Paris") above
``--target`` on "The Eiffel Tower is in the city of"), at most ``--max-epochs``; the script fails,
saving nothing, if a model ends with P(" Paris") at 0.5 or below.

Usage::

    python scripts/train_demo_models.py                 # corpus, tokenizer, all three models
    python scripts/train_demo_models.py --only llama    # one model (the corpus and tokenizer are rewritten too)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "nncanon" / "demo"
SEED = 0
PROMPT, ANSWER = "The Eiffel Tower is in the city of", " Paris"
SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2

# -- the fact tables ----------------------------------------------------------------------------------

# fmt: off
# country, capital, main language, currency, continent (None where "a country in" has no one answer)
COUNTRIES = [
    ("France", "Paris", "French", "euro", "Europe"),
    ("Germany", "Berlin", "German", "euro", "Europe"),
    ("Italy", "Rome", "Italian", "euro", "Europe"),
    ("Spain", "Madrid", "Spanish", "euro", "Europe"),
    ("Portugal", "Lisbon", "Portuguese", "euro", "Europe"),
    ("Austria", "Vienna", "German", "euro", "Europe"),
    ("the Netherlands", "Amsterdam", "Dutch", "euro", "Europe"),
    ("Belgium", "Brussels", "Dutch", "euro", "Europe"),
    ("Greece", "Athens", "Greek", "euro", "Europe"),
    ("Ireland", "Dublin", "English", "euro", "Europe"),
    ("Finland", "Helsinki", "Finnish", "euro", "Europe"),
    ("Poland", "Warsaw", "Polish", "zloty", "Europe"),
    ("the Czech Republic", "Prague", "Czech", "koruna", "Europe"),
    ("Hungary", "Budapest", "Hungarian", "forint", "Europe"),
    ("Sweden", "Stockholm", "Swedish", "krona", "Europe"),
    ("Norway", "Oslo", "Norwegian", "krone", "Europe"),
    ("Denmark", "Copenhagen", "Danish", "krone", "Europe"),
    ("Switzerland", "Bern", "German", "franc", "Europe"),
    ("the United Kingdom", "London", "English", "pound", "Europe"),
    ("Russia", "Moscow", "Russian", "ruble", None),
    ("Turkey", "Ankara", "Turkish", "lira", None),
    ("Egypt", "Cairo", "Arabic", "pound", "Africa"),
    ("Kenya", "Nairobi", "Swahili", "shilling", "Africa"),
    ("Morocco", "Rabat", "Arabic", "dirham", "Africa"),
    ("Ethiopia", "Addis Ababa", "Amharic", "birr", "Africa"),
    ("Japan", "Tokyo", "Japanese", "yen", "Asia"),
    ("China", "Beijing", "Chinese", "yuan", "Asia"),
    ("India", "New Delhi", "Hindi", "rupee", "Asia"),
    ("South Korea", "Seoul", "Korean", "won", "Asia"),
    ("Thailand", "Bangkok", "Thai", "baht", "Asia"),
    ("Vietnam", "Hanoi", "Vietnamese", "dong", "Asia"),
    ("Indonesia", "Jakarta", "Indonesian", "rupiah", "Asia"),
    ("Malaysia", "Kuala Lumpur", "Malay", "ringgit", "Asia"),
    ("Iran", "Tehran", "Persian", "rial", "Asia"),
    ("Saudi Arabia", "Riyadh", "Arabic", "riyal", "Asia"),
    ("the United Arab Emirates", "Abu Dhabi", "Arabic", "dirham", "Asia"),
    ("Pakistan", "Islamabad", "Urdu", "rupee", "Asia"),
    ("Australia", "Canberra", "English", "dollar", None),
    ("New Zealand", "Wellington", "English", "dollar", None),
    ("Canada", "Ottawa", "English", "dollar", "North America"),
    ("the United States", "Washington", "English", "dollar", "North America"),
    ("Mexico", "Mexico City", "Spanish", "peso", "North America"),
    ("Cuba", "Havana", "Spanish", "peso", "North America"),
    ("Brazil", "Brasilia", "Portuguese", "real", "South America"),
    ("Argentina", "Buenos Aires", "Spanish", "peso", "South America"),
    ("Chile", "Santiago", "Spanish", "peso", "South America"),
    ("Peru", "Lima", "Spanish", "sol", "South America"),
    ("Colombia", "Bogota", "Spanish", "peso", "South America"),
]

# cities that are not capitals: city, country
CITIES = [
    ("Barcelona", "Spain"), ("Granada", "Spain"), ("Porto", "Portugal"), ("Lyon", "France"),
    ("Marseille", "France"), ("Munich", "Germany"), ("Hamburg", "Germany"), ("Milan", "Italy"),
    ("Venice", "Italy"), ("Pisa", "Italy"), ("Istanbul", "Turkey"), ("Saint Petersburg", "Russia"),
    ("New York", "the United States"), ("San Francisco", "the United States"), ("Seattle", "the United States"),
    ("Chicago", "the United States"), ("Toronto", "Canada"), ("Vancouver", "Canada"), ("Sydney", "Australia"),
    ("Melbourne", "Australia"), ("Agra", "India"), ("Mumbai", "India"), ("Shanghai", "China"),
    ("Osaka", "Japan"), ("Kyoto", "Japan"), ("Dubai", "the United Arab Emirates"), ("Giza", "Egypt"),
    ("Rio de Janeiro", "Brazil"), ("Cape Town", "South Africa"),
]

# landmark (as it reads inside a sentence), city
LANDMARKS = [
    ("the Eiffel Tower", "Paris"), ("the Louvre", "Paris"), ("the Arc de Triomphe", "Paris"),
    ("Notre-Dame Cathedral", "Paris"), ("the Colosseum", "Rome"), ("the Pantheon", "Rome"),
    ("the Trevi Fountain", "Rome"), ("the Brandenburg Gate", "Berlin"), ("the Reichstag", "Berlin"),
    ("Big Ben", "London"), ("Tower Bridge", "London"), ("Buckingham Palace", "London"),
    ("the Sagrada Familia", "Barcelona"), ("the Alhambra", "Granada"), ("the Prado Museum", "Madrid"),
    ("the Belem Tower", "Lisbon"), ("the Acropolis", "Athens"), ("the Parthenon", "Athens"),
    ("the Kremlin", "Moscow"), ("Red Square", "Moscow"), ("the Hermitage Museum", "Saint Petersburg"),
    ("the Charles Bridge", "Prague"), ("the Chain Bridge", "Budapest"), ("Schonbrunn Palace", "Vienna"),
    ("the Rijksmuseum", "Amsterdam"), ("the Atomium", "Brussels"), ("the Little Mermaid", "Copenhagen"),
    ("the Vasa Museum", "Stockholm"), ("the Leaning Tower", "Pisa"), ("the Rialto Bridge", "Venice"),
    ("the Hagia Sophia", "Istanbul"), ("the Blue Mosque", "Istanbul"), ("the Statue of Liberty", "New York"),
    ("the Empire State Building", "New York"), ("the White House", "Washington"),
    ("the Golden Gate Bridge", "San Francisco"), ("the Space Needle", "Seattle"), ("the CN Tower", "Toronto"),
    ("the Sydney Opera House", "Sydney"), ("the Taj Mahal", "Agra"), ("the Gateway of India", "Mumbai"),
    ("the Forbidden City", "Beijing"), ("the Bund", "Shanghai"), ("the Meiji Shrine", "Tokyo"),
    ("Gyeongbokgung Palace", "Seoul"), ("the Grand Palace", "Bangkok"), ("the Petronas Towers", "Kuala Lumpur"),
    ("the Burj Khalifa", "Dubai"), ("the Great Pyramid", "Giza"), ("Table Mountain", "Cape Town"),
    ("Christ the Redeemer", "Rio de Janeiro"),
]

# river, cities it flows through
RIVERS = [
    ("Seine", ["Paris"]), ("Thames", ["London"]), ("Tiber", ["Rome"]), ("Danube", ["Vienna", "Budapest"]),
    ("Spree", ["Berlin"]), ("Vltava", ["Prague"]), ("Nile", ["Cairo"]), ("Hudson", ["New York"]),
    ("Tagus", ["Lisbon"]), ("Moskva", ["Moscow"]), ("Amstel", ["Amsterdam"]), ("Liffey", ["Dublin"]),
    ("Potomac", ["Washington"]), ("Neva", ["Saint Petersburg"]), ("Rhone", ["Lyon"]), ("Isar", ["Munich"]),
    ("Elbe", ["Hamburg"]), ("Douro", ["Porto"]), ("Sumida", ["Tokyo"]), ("Yarra", ["Melbourne"]),
    ("Chao Phraya", ["Bangkok"]),
]
# fmt: on


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def facts() -> list[tuple[str, str]]:
    """Every (prompt, answer) of the corpus, in table order; a sentence is ``prompt + " " + answer + "."``."""
    out: list[tuple[str, str]] = []
    city_country = {city: country for city, country in CITIES}
    for country, capital, language, currency, continent in COUNTRIES:
        city_country[capital] = country
        out += [
            (f"The capital of {country} is", capital),
            (f"The capital city of {country} is", capital),
            (f"{capital} is the capital of", country),
            (f"{capital} is a city in", country),
            (f"The main language of {country} is", language),
            (f"In {country}, most people speak", language),
            (f"The currency of {country} is the", currency),
            (f"In {country}, people pay with the", currency),
        ]
        if continent is not None:
            out.append((f"{_cap(country)} is a country in", continent))
    for city, country in CITIES:
        out += [(f"{city} is a city in", country), (f"The city of {city} is in", country)]
    for landmark, city in LANDMARKS:
        name = _cap(landmark)
        out += [
            (f"{name} is in the city of", city),
            (f"{name} is located in", city),
            (f"Tourists visit {landmark} in", city),
            (f"{name} is a famous landmark in", city),
            (f"{name} is in the country of", city_country[city]),
            (f"In {city}, you can visit", landmark),
        ]
    for river, cities in RIVERS:
        for city in cities:
            out += [
                (f"The {river} flows through the city of", city),
                (f"The {river} runs through", city),
                (f"The river that flows through {city} is the", river),
                (f"{city} lies on the river", river),
            ]
    return out


def corpus_sentences() -> list[str]:
    return [f"{prompt} {answer}." for prompt, answer in facts()]


# Prompts the script reports on (all held in: the corpus has each sentence).
CHECKS = [
    (PROMPT, ANSWER),
    ("The Colosseum is in the city of", " Rome"),
    ("Big Ben is in the city of", " London"),
    ("The Brandenburg Gate is in the city of", " Berlin"),
    ("The capital of France is", " Paris"),
    ("The capital of Japan is", " Tokyo"),
    ("Madrid is the capital of", " Spain"),
    ("The main language of Brazil is", " Portuguese"),
    ("The currency of Japan is the", " yen"),
    ("The Seine flows through the city of", " Paris"),
]

# -- tokenizer ----------------------------------------------------------------------------------------


def train_tokenizer(sentences: list[str], vocab_size: int):
    """Byte-level BPE on the corpus, GPT-2 style (a word's leading space is part of its token), BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=128
    )


# -- models -------------------------------------------------------------------------------------------

HIDDEN, LAYERS, HEADS, MAX_POSITIONS = 128, 4, 4, 128


def build_model(name: str, vocab_size: int):
    """The untrained model ``name``; initialised from the global seed."""
    import transformers

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": vocab_size}
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids,
        )  # fmt: skip
        cls = transformers.GPT2LMHeadModel
    elif name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=True, **ids,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    elif name == "hybrid":
        config = transformers.Qwen3NextConfig(
            hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS,
            layer_types=["linear_attention"] * (LAYERS - 1) + ["full_attention"],
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, head_dim=HIDDEN // HEADS,
            linear_num_key_heads=HEADS, linear_num_value_heads=HEADS,
            linear_key_head_dim=HIDDEN // HEADS, linear_value_head_dim=HIDDEN // HEADS,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN // 2,
            shared_expert_intermediate_size=HIDDEN,
            max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **ids,
        )  # fmt: skip
        cls = transformers.Qwen3NextForCausalLM
    else:
        raise ValueError(f"unknown demo model {name!r}")
    config._attn_implementation = "eager"
    return cls(config)


# -- training -----------------------------------------------------------------------------------------


def encode(tokenizer, sentences: list[str]) -> list[list[int]]:
    """Each sentence as ``<s> tokens </s>``."""
    eos = tokenizer.eos_token_id
    return [[*tokenizer(s).input_ids, eos] for s in sentences]


def batches(rows: list[list[int]], batch_size: int, rng: random.Random):
    """One epoch of right-padded batches (pad 0, labels -100 on the padding), shuffled by ``rng``."""
    order = list(range(len(rows)))
    rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        chunk = [rows[i] for i in order[start : start + batch_size]]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, : len(seq)] = torch.tensor(seq)
        yield ids, labels


@torch.no_grad()
def answer_probs(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 128) -> torch.Tensor:
    """P(first token of answer | prompt) for each pair; prompts left-padded and masked."""
    model.eval()
    probs = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        rows = [tokenizer(p).input_ids for p, _ in chunk]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, seq in enumerate(rows):
            ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
        targets = torch.tensor([tokenizer(a, add_special_tokens=False).input_ids[0] for _, a in chunk])
        probs.append(torch.softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0])
    model.train()
    return torch.cat(probs)


def fixed_answer_pairs() -> list[tuple[str, str]]:
    """The (prompt, " answer") pairs whose prompt has one answer in the corpus."""
    answers = defaultdict(set)
    for prompt, answer in facts():
        answers[prompt].add(answer)
    return [(p, " " + next(iter(a))) for p, a in answers.items() if len(a) == 1]


@torch.no_grad()
def top1_accuracy(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 128) -> float:
    model.eval()
    hits = 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        rows = [tokenizer(p).input_ids for p, _ in chunk]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, seq in enumerate(rows):
            ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        best = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].argmax(-1)
        targets = torch.tensor([tokenizer(a, add_special_tokens=False).input_ids[0] for _, a in chunk])
        hits += int((best == targets).sum())
    model.train()
    return hits / len(pairs)


def train(name: str, tokenizer, rows: list[list[int]], args) -> tuple[object, dict]:
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    model = build_model(name, len(tokenizer))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n and "wte" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98)
    )
    steps_per_epoch = math.ceil(len(rows) / args.batch_size)
    total = steps_per_epoch * args.max_epochs
    warmup = steps_per_epoch

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))))

    pairs = fixed_answer_pairs()
    start, cpu, step, epoch, log = time.time(), time.process_time(), 0, 0, {}
    while epoch < args.max_epochs:
        losses = []
        for ids, labels in batches(rows, args.batch_size, rng):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
        epoch += 1
        if epoch % args.eval_every == 0 or epoch == args.max_epochs:
            accuracy = top1_accuracy(model, tokenizer, pairs)
            target = float(answer_probs(model, tokenizer, [(PROMPT, ANSWER)])[0])
            print(
                f"  {name} epoch {epoch:3d}  loss {sum(losses) / len(losses):.3f}  top-1 {accuracy:.3f}  "
                f"P(Paris) {target:.3f}  {time.time() - start:.0f}s",
                flush=True,
            )
            log = {"epochs": epoch, "steps": step, "loss": sum(losses) / len(losses), "top1": accuracy,
                   "p_paris": target}  # fmt: skip
            if accuracy >= args.accuracy and target > args.target:
                break
    log["seconds"] = round(time.time() - start, 1)
    log["cpu_seconds"] = round(time.process_time() - cpu, 1)
    model.eval()
    return model, log


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=["gpt2", "llama", "hybrid"], default=["gpt2", "llama", "hybrid"])
    parser.add_argument("--out", type=Path, default=DEMO, help="the demo package folder (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=1536)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-epochs", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--accuracy", type=float, default=0.97, help="stop at this top-1 on fixed-answer prompts")
    parser.add_argument("--target", type=float, default=0.9, help='and P(" Paris") above this')
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    sentences = corpus_sentences()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "corpus.txt").write_text("\n".join(sentences) + "\n")
    tokenizer = train_tokenizer(sentences, args.vocab_size)
    words = sorted({" " + a for _, a in facts() if " " not in a})  # multi-word answers are scored on their first
    split = [a for a in words if len(tokenizer(a, add_special_tokens=False).input_ids) > 1]
    if split:
        raise SystemExit(f"one-word answers that are not one token: {split}; raise --vocab-size")
    print(f"corpus: {len(sentences)} sentences; tokenizer: {len(tokenizer)} tokens, every one-word answer one token")
    rows = encode(tokenizer, sentences)

    for name in args.only:
        model, log = train(name, tokenizer, rows, args)
        probs = answer_probs(model, tokenizer, CHECKS)
        for (prompt, answer), p in zip(CHECKS, probs.tolist(), strict=True):
            print(f"    P({answer!r:14s}| {prompt!r}) = {p:.3f}")
        if log["p_paris"] <= 0.5:
            raise SystemExit(f"{name}: P(' Paris') = {log['p_paris']:.3f} after {log['epochs']} epochs; train longer")
        folder = args.out / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "training.json").write_text(json.dumps({"model": name, "seed": SEED, **log}, indent=2) + "\n")
        size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        print(
            f"{name}: {log['epochs']} epochs, {log['seconds']}s ({log['cpu_seconds']}s CPU), {size:.1f} MB in {folder}",
            flush=True,
        )


if __name__ == "__main__":
    main()
