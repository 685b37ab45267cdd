"""Generate a second routing task: customer-support messages labelled with the team that handles them.

    python configs/data/make_tickets.py      # rewrites tickets_{train,val}.jsonl beside this file

Five labels, 400 training chats and 100 held-out chats (balanced). Unlike the
quickstart's split, which draws train and validation from the same templates,
every label's templates are split in two: the held-out chats use only phrasings
(templates) that never occur in training, so exact match on them measures
generalisation to new wording, not recall of a seen sentence with another slot
filled in. The output is deterministic (seeded).
"""

from __future__ import annotations

import random

SYSTEM = "Route the customer message to a support team. Answer with the team label only."

PRODUCTS = ["blender", "phone case", "desk lamp", "running shoes", "coffee grinder", "backpack", "headphones",
            "yoga mat", "kettle", "smartwatch"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]
AMOUNTS = ["$12", "$19.99", "$35", "$49", "$60", "$7.50", "$120", "$24", "$89", "$15"]
DAYS = ["two days", "a week", "ten days", "three weeks", "five days", "a month", "since Monday", "since Friday"]
OPEN = ["", "hi, ", "hello, ", "hey there, ", "good morning, ", "excuse me, ", "quick question: ", "urgent: "]
CLOSE = ["", " thanks", " thank you", " please help", " any idea?", " cheers", " asap", " what now?"]

# label -> (training templates, held-out templates): the held-out wording never appears in training.
INTENTS: dict[str, tuple[list[str], list[str]]] = {
    "billing_team": (
        ["I was charged twice for my {product}", "why is there a {amount} charge on my card",
         "my invoice for {month} looks wrong", "can I get a receipt for the {product}",
         "you billed me {amount} more than the listed price", "my card was debited but the order failed",
         "please update the credit card on file", "the {month} statement shows a fee I never agreed to"],
        ["there's a double payment on my bank account for the {product}",
         "the amount taken from my card doesn't match checkout",
         "who do I talk to about an overcharge of {amount}"]),
    "shipping_team": (
        ["where is my {product}, it's been {days}", "my package still says in transit after {days}",
         "the tracking number for my {product} doesn't work", "can you ship the {product} to a different address",
         "the courier left my parcel at the wrong house", "when will the {product} arrive",
         "my order hasn't shipped yet after {days}", "the delivery date keeps moving for my {product}"],
        ["still waiting on the {product} I ordered {days} ago, no sign of it",
         "the driver never showed up with my box",
         "has my {product} even left your warehouse"]),
    "returns_team": (
        ["I want to send the {product} back", "how do I return the {product}",
         "the {product} arrived broken, I need a replacement", "can I exchange the {product} for another size",
         "I'd like a refund for the {product}", "the {product} isn't what I ordered, I want to return it",
         "please send me a return label for the {product}", "is it too late to return something I bought in {month}"],
        ["the {product} was damaged in the box so I'd like my money back",
         "I changed my mind about the {product}, can it go back",
         "what's the process to swap a faulty {product}"]),
    "tech_support": (
        ["the {product} won't turn on", "my {product} keeps disconnecting from bluetooth",
         "the app crashes when I pair the {product}", "how do I reset the {product} to factory settings",
         "the {product} firmware update failed", "the battery on my {product} dies after {days}",
         "the {product} makes a strange noise when running", "the screen on the {product} is frozen"],
        ["my {product} stopped working after the latest update",
         "nothing happens when I press the power button on the {product}",
         "the {product} won't connect to my phone no matter what I try"]),
    "account_team": (
        ["I can't log in to my account", "please reset my password",
         "how do I change the email on my account", "I want to delete my account",
         "my account got locked after too many attempts", "someone else may be using my login",
         "I never received the verification email", "how do I turn on two-factor authentication"],
        ["the sign-in page says my password is wrong but it isn't",
         "I'd like to update the phone number tied to my profile",
         "please close my profile and remove my data"]),
}


def fill(template: str, rng: random.Random) -> str:
    text = template.format(product=rng.choice(PRODUCTS), month=rng.choice(MONTHS), amount=rng.choice(AMOUNTS),
                           days=rng.choice(DAYS))
    return (rng.choice(OPEN) + text + rng.choice(CLOSE)).strip()


def record(message: str, label: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": message},
                         {"role": "assistant", "content": label}]}


def draw(part: int, per_label: int, rng: random.Random, seen: set[str]) -> list[dict]:
    rows = []
    for label in sorted(INTENTS):
        templates, n = INTENTS[label][part], 0
        while n < per_label:
            message = fill(rng.choice(templates), rng)
            if message.lower() in seen:
                continue
            seen.add(message.lower())
            rows.append(record(message, label))
            n += 1
    rng.shuffle(rows)
    return rows


def generate(n_train: int = 400, n_val: int = 100, seed: int = 31) -> tuple[list[dict], list[dict]]:
    rng, seen = random.Random(seed), set()
    return draw(0, n_train // len(INTENTS), rng, seen), draw(1, n_val // len(INTENTS), rng, seen)


def main() -> None:
    from make_smart_home import write_splits      # this script's folder is on sys.path when it runs

    train, val = generate()
    write_splits({"tickets_train.jsonl": train, "tickets_val.jsonl": val})


if __name__ == "__main__":
    main()
