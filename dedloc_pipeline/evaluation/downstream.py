"""Downstream Bengali evaluation: fine-tune a pretrained ALBERT encoder, and the same model from random init.

DeDLOC scored sahajBERT on WikiANN bn (NER, span F1) and IndicGLUE Soham news (6-way
classification, accuracy). Both live on the Hugging Face hub, so the project also builds offline
stand-ins of the same shape; ``TaskData.source`` says which one a score comes from.
"""

from __future__ import annotations

import copy
import math
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from seqeval.metrics import f1_score, precision_score, recall_score
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)

IGNORE = -100  # label id the loss skips: special tokens and non-first sub-tokens
NER_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]  # WikiANN's order


@dataclass
class TaskData:
    """NER examples are ``(words, IOB2 tags)``; classification examples are ``(text, label)``."""
    name: str
    kind: Literal["ner", "classification"]
    labels: list[str]
    train: list
    validation: list
    test: list
    source: str


def wikiann_bn() -> TaskData:
    """WikiANN bn from the hub (sahajBERT's NER benchmark)."""
    import datasets
    ds = datasets.load_dataset("wikiann", "bn")
    names = list(ds["train"].features["ner_tags"].feature.names)
    split = lambda s: [(list(r["tokens"]), [names[t] for t in r["ner_tags"]]) for r in ds[s]]
    return TaskData("wikiann-bn", "ner", names, split("train"), split("validation"), split("test"),
                    "WikiANN bn (hub: wikiann/bn)")


def soham_bn() -> TaskData:
    """IndicGLUE Soham news article classification from the hub (sahajBERT's classification benchmark)."""
    import datasets
    ds = datasets.load_dataset("ai4bharat/indic_glue", "sna.bn")
    names = list(ds["train"].features["label"].names)
    split = lambda s: [(r["text"], names[r["label"]]) for r in ds[s]]
    return TaskData("soham-bn", "classification", names, split("train"), split("validation"), split("test"),
                    "IndicGLUE Soham news, sna.bn (hub: ai4bharat/indic_glue)")


# Slots are whole words; text glued after a slot (a case ending) joins the entity's last word.
TEMPLATES = [
    "{PER} গতকাল {LOC} থেকে ফিরেছেন ।",
    "{ORG} {LOC} শহরে একটি নতুন কারখানা চালু করেছে ।",
    "{PER} বর্তমানে {ORG} প্রতিষ্ঠানে প্রধান নির্বাহী হিসেবে কাজ করছেন ।",
    "আগামী মাসে {PER} {LOC} সফরে যাবেন ।",
    "{LOC} ও {LOC} নতুন বাণিজ্য চুক্তিতে সই করেছে ।",
    "সংবাদ সম্মেলনে {PER} বলেন , {ORG} শিগগিরই শেয়ারবাজারে আসবে ।",
    "{PER}কে {ORG}-এর নতুন চেয়ারম্যান নিযুক্ত করা হয়েছে ।",
    "বন্যার কারণে {LOC} অঞ্চলে জনজীবন বিপর্যস্ত ।",
    "{PER} ও {PER} একসাথে {LOC} ভ্রমণে গিয়েছিলেন ।",
    "{ORG} এ বছর রেকর্ড মুনাফা করেছে ।",
    "আমার বন্ধু {PER} এখন {LOC}-এ থাকে ।",
    "{LOC} দলের হয়ে {PER} দুর্দান্ত সেঞ্চুরি করেছেন ।",
    "গত সপ্তাহে {ORG} ও {ORG} একীভূত হওয়ার ঘোষণা দিয়েছে ।",
    "{PER} জানান , {LOC} থেকে আমদানি বাড়ছে ।",
    "প্রতিবেদনে বলা হয়েছে যে {ORG} {LOC} বাজারে ব্যবসা সম্প্রসারণ করবে ।",
    "{PER}-এর লেখা নতুন বইটি পাঠকমহলে সাড়া ফেলেছে ।",
    "আজ সকালে {LOC} বিমানবন্দরে {PER}কে স্বাগত জানানো হয় ।",
    "{ORG} কর্মীদের বেতন বাড়ানোর সিদ্ধান্ত নিয়েছে ।",
    "অনুষ্ঠানে প্রধান অতিথি ছিলেন {PER} ।",
    "{LOC} সরকার {ORG}কে নতুন লাইসেন্স দিয়েছে ।",
]
SLOT = re.compile(r"\{(PER|ORG|LOC)\}(\S*)")


def _thirds(items, rng: random.Random) -> list[list[str]]:
    """60/20/20 split of the distinct items: disjoint names per split, so the test measures generalisation."""
    items = sorted(set(items))
    rng.shuffle(items)
    a, b = round(0.6 * len(items)), round(0.8 * len(items))
    return [items[:a], items[a:b], items[b:]]


def _entity_pools(rng: random.Random) -> list[dict[str, list[str]]]:
    from faker.providers.address.bn_BD import Provider as Address
    from faker.providers.company.bn_BD import Provider as Company
    from faker.providers.person.bn_BD import Provider as Person
    first, last = _thirds(Person.first_names, rng), _thirds(Person.last_names, rng)
    cities, countries, companies = (_thirds(x, rng) for x in (Address.cities, Address.countries, Company.companies))
    return [{"PER": [f"{f} {name}" for f in first[i] for name in last[i]], "LOC": cities[i] + countries[i],
             "ORG": companies[i]} for i in range(3)]


def _sentence(template: str, pool: dict[str, list[str]], rng: random.Random) -> tuple[list[str], list[str]]:
    words, tags = [], []
    for word in template.split():
        slot = SLOT.fullmatch(word)
        if not slot:
            words.append(word)
            tags.append("O")
            continue
        kind, suffix = slot.groups()
        entity = rng.choice(pool[kind]).split()
        entity[-1] += suffix
        words += entity
        tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1)
    return words, tags


def offline_ner(seed: int = 0, n_train: int = 600, n_val: int = 150, n_test: int = 150) -> TaskData:
    """Templated Bengali sentences with Faker bn_BD names; the names never cross splits, templates do."""
    rng = random.Random(seed)
    pools = _entity_pools(rng)
    splits = [[_sentence(rng.choice(TEMPLATES), pool, rng) for _ in range(n)]
              for pool, n in zip(pools, (n_train, n_val, n_test))]
    return TaskData("offline-ner-bn", "ner", list(NER_LABELS), *splits,
                    "offline stand-in: templated Bengali sentences with Faker bn_BD entity names")


def offline_news(corpus_dir, seed: int = 0, n_labels: int = 6,
                 per_label: tuple[int, int, int] = (200, 50, 50)) -> TaskData:
    """LibreOffice bn UI strings labelled by their catalog module (the most frequent ``n_labels``).

    Texts are deduplicated and a text found under two of the chosen modules is dropped, so every
    label is the true origin. Each split takes at most ``per_label`` (train, validation, test) per module.
    """
    path = Path(corpus_dir) / "libreoffice.tsv"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: build the offline corpus with `make corpus`")
    rows = [line.split("\t", 1) for line in path.read_text(encoding="utf-8").splitlines() if "\t" in line]
    counts = Counter(module for module, _ in rows)
    labels = [m for m, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n_labels]]
    modules_of = defaultdict(set)
    for module, text in rows:
        if module in labels:
            modules_of[text].add(module)
    rng = random.Random(seed)
    n_train, n_val, n_test = per_label
    splits = [[], [], []]
    for label in labels:
        texts = sorted(t for t, mods in modules_of.items() if mods == {label})
        rng.shuffle(texts)
        cuts = (texts[n_test + n_val:][:n_train], texts[n_test:n_test + n_val], texts[:n_test])
        for split, chunk in zip(splits, cuts):
            split += [(t, label) for t in chunk]
    for split in splits:
        rng.shuffle(split)
    return TaskData("offline-news-bn", "classification", labels, *splits,
                    "offline stand-in: LibreOffice bn UI strings (libreoffice-l10n-bn) labelled by catalog module")


def encode_ner(tokenizer: PreTrainedTokenizerFast, words: list[str], tags: list[str], labels: list[str],
               seq_len: int) -> tuple[list[int], list[int], dict[int, int]]:
    """Input ids, label ids on each word's first sub-token only, and word -> that token's position."""
    enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=seq_len)
    label_ids, heads, prev = [], {}, None
    for pos, word in enumerate(enc.word_ids()):
        if word is not None and word != prev:
            heads[word] = pos
            label_ids.append(labels.index(tags[word]))
        else:
            label_ids.append(IGNORE)
        prev = word
    return enc["input_ids"], label_ids, heads


def _encode(task: TaskData, tokenizer, examples, seq_len: int) -> list[tuple]:
    if task.kind == "ner":
        return [encode_ner(tokenizer, words, tags, task.labels, seq_len) for words, tags in examples]
    return [(tokenizer(text, truncation=True, max_length=seq_len)["input_ids"], task.labels.index(label), None)
            for text, label in examples]


def _batch(items: list[tuple], pad_id: int, ner: bool):
    """Padded to the longest item of the batch, not to seq_len: most sentences are far shorter."""
    width = max(len(ids) for ids, _, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE) if ner else torch.tensor([y for _, y, _ in items])
    for i, (x, y, _) in enumerate(items):
        ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
        if ner:
            labels[i, :len(x)] = torch.tensor(y)
    return ids, mask, labels


@torch.no_grad()
def evaluate(model, task: TaskData, tokenizer: PreTrainedTokenizerFast, examples: list, *, seq_len: int = 128,
             batch_size: int = 32) -> dict[str, float]:
    """NER: seqeval span scores over whole words; a word left without a sub-token (cut off by
    truncation) is predicted O, so its gold entity still counts against recall."""
    encoded, ner = _encode(task, tokenizer, examples, seq_len), task.kind == "ner"
    model.eval()
    preds = []
    for i in range(0, len(encoded), batch_size):
        ids, mask, _ = _batch(encoded[i:i + batch_size], tokenizer.pad_token_id, ner)
        preds += model(input_ids=ids, attention_mask=mask).logits.argmax(-1).tolist()
    if not ner:
        return {"accuracy": sum(p == y for p, (_, y, _) in zip(preds, encoded)) / len(encoded)}
    gold = [tags for _, tags in examples]
    pred = [["O"] * len(tags) for tags in gold]
    for tags, p, (_, _, heads) in zip(pred, preds, encoded):
        for word, pos in heads.items():
            tags[word] = task.labels[p[pos]]
    return {name: float(score(gold, pred, zero_division=0))
            for name, score in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score))}


def build_model(task: TaskData, config: AlbertConfig, encoder: dict[str, torch.Tensor] | None):
    """The task's ALBERT head on ``encoder`` (random init when None).

    The pooler is optional both ways: AlbertForPreTraining carries one, the masked-LM model does not,
    and token classification does not use it. Any other mismatch is an error.
    """
    config = copy.deepcopy(config)
    config.id2label = dict(enumerate(task.labels))
    config.label2id = {label: i for i, label in enumerate(task.labels)}
    model = (AlbertForTokenClassification if task.kind == "ner" else AlbertForSequenceClassification)(config)
    if encoder is not None:
        missing, unexpected = model.albert.load_state_dict(encoder, strict=False)
        wrong = [k for k in missing + unexpected if not k.startswith("pooler.")]
        if wrong:
            raise ValueError(f"encoder does not fit the model, e.g. {wrong[:4]}")
    return model


def finetune(task: TaskData, tokenizer: PreTrainedTokenizerFast, config: AlbertConfig,
             encoder: dict[str, torch.Tensor] | None, *, seed: int = 0, epochs: int = 20, patience: int = 3,
             lr: float = 5e-5, batch_size: int = 32, seq_len: int = 128, max_train: int | None = None,
             warmup: float = 0.1, weight_decay: float = 0.01) -> dict:
    """AdamW with linear warmup and decay; validation after every epoch; stop after ``patience`` epochs
    without improvement; test with the best validation weights."""
    if patience < 1:
        raise ValueError("patience counts epochs without improvement and must be at least 1")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = build_model(task, config, encoder)
    train = task.train if max_train is None or max_train >= len(task.train) else rng.sample(task.train, max_train)
    pad, ner = tokenizer.pad_token_id, task.kind == "ner"
    train_enc = _encode(task, tokenizer, train, seq_len)
    metric = "f1" if ner else "accuracy"
    score = lambda examples: evaluate(model, task, tokenizer, examples, seq_len=seq_len, batch_size=batch_size)
    decays = {n: p.ndim > 1 and "LayerNorm" not in n for n, p in model.named_parameters()}  # not biases, norms
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if decays[n] == d],
                              "weight_decay": weight_decay if d else 0.0} for d in (True, False)], lr=lr)
    steps = epochs * math.ceil(len(train_enc) / batch_size)
    schedule = get_linear_schedule_with_warmup(opt, int(warmup * steps), steps)
    best, best_epoch, best_state, history = -1.0, 0, None, []
    for epoch in range(1, epochs + 1):
        model.train()
        order = list(range(len(train_enc)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            ids, mask, labels = _batch([train_enc[j] for j in order[i:i + batch_size]], pad, ner)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            opt.zero_grad()
        history.append(score(task.validation)[metric])
        if history[-1] > best:
            best, best_epoch, best_state = history[-1], epoch, copy.deepcopy(model.state_dict())
        elif epoch - best_epoch >= patience:
            break
    model.load_state_dict(best_state)
    scores = score(task.test)
    return {"task": task.name, "source": task.source, "metric": metric, "test": scores[metric], "validation": best,
            "test_scores": scores, "validation_history": history, "epochs_run": len(history),
            "best_epoch": best_epoch, "train_examples": len(train_enc)}


def compare(task: TaskData, tokenizer: PreTrainedTokenizerFast, config: AlbertConfig,
            encoder: dict[str, torch.Tensor], **kw) -> dict:
    """The pretrained encoder next to random init; same seed, so the task head starts identical."""
    pretrained = finetune(task, tokenizer, config, encoder, **kw)
    random_init = finetune(task, tokenizer, config, None, **kw)
    return {"task": task.name, "source": task.source, "metric": pretrained["metric"],
            "pretrained": pretrained, "random_init": random_init}
