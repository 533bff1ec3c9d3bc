"""Synthetic children's stories in the style of TinyStories, generated from templates with a seed.

This is NOT real text: it exists so that `kvlm prepare` and the tests work on a machine with no
download. Each story introduces characters, an object, a place and a count early and refers back to
them near the end ("... and Lily kept the red kite safe"), so predicting the late tokens needs
attention over distance, the thing the attention variants differ in. The vocabulary is small
(about 700 words), so a byte-level BPE saturates near 1,100 tokens: every word becomes one token.

Story i of seed s is a pure function of (s, i): any slice of the stream can be regenerated.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

LABEL = "synthetic-stories (generated, not real text)"

GIRLS = (
    "Lily Mia Emma Sara Lucy Anna Zoe Ella Ruby Nora Rosa Amy Kim Jane Maya Ivy Lola Daisy Grace Hana".split()
)
BOYS = "Tom Max Ben Sam Leo Tim Jack Finn Noah Jake Eli Owen Luke Dan Theo Hugo Omar Ravi Kai Paul".split()
ANIMALS = [
    ("puppy", "Spot"),
    ("kitten", "Mittens"),
    ("bunny", "Hop"),
    ("bear", "Bruno"),
    ("bird", "Tweet"),
    ("duck", "Quack"),
    ("frog", "Fred"),
    ("mouse", "Pip"),
    ("fox", "Rusty"),
    ("dragon", "Blaze"),
    ("turtle", "Shelly"),
    ("owl", "Hoot"),
]
ADJ = "red blue green yellow big little shiny soft old new pink purple striped golden".split()
OBJECTS = "ball kite boat hat car doll drum book cup box key shell train balloon crayon blanket".split()
PLACES = ["park", "garden", "forest", "beach", "pond", "hill", "farm", "kitchen", "school", "river"]
HIDE = [
    "under a big rock",
    "behind a tree",
    "in a pile of leaves",
    "under the bed",
    "next to the fence",
    "inside an old box",
    "on top of a bush",
    "near the water",
]
GAMES = ["tag", "hide and seek", "catch", "with blocks", "in the sand", "with a rope", "pretend"]
FEEL_BAD = ["sad", "scared", "upset", "worried", "angry", "lonely"]
FEEL_GOOD = ["happy", "glad", "proud", "excited", "calm", "thankful"]
THINGS = ["apples", "flowers", "stones", "stars", "cookies", "birds", "clouds", "shells"]
WEATHER = [
    "The sun was warm and bright.",
    "The sky was gray and it started to rain.",
    "A soft wind blew through the trees.",
    "It was a cold day, and the ground was white with snow.",
    "The clouds looked like big white sheep.",
]
FILLER = [
    "{A} saw a {adj2} butterfly and ran after it.",
    "{B} sang a little song about the {place}.",
    "They ate some cookies and drank some water.",
    "{A} jumped over a puddle and laughed.",
    "A small {animal} watched them from far away.",
    "{B} showed {A} a funny stone.",
    "They sat down to rest under a tall tree.",
    "{A} told {B} a story about a {adj2} {obj2}.",
    "The wind made the leaves dance.",
    "{B} picked a flower and gave it to {A}.",
]
MORALS = [
    "sharing makes everyone happy",
    "friends help each other",
    "it is good to be brave",
    "you should always say sorry",
    "being kind is the best thing",
    "it is important to be careful",
]
NUMBERS = ["two", "three", "four", "five", "six", "seven"]


class _Cast:
    """The story's recurring entities, chosen once so that later sentences refer back to them."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        girl = rng.random() < 0.5
        self.A = rng.choice(GIRLS if girl else BOYS)
        self.he = "she" if girl else "he"
        self.his = "her" if girl else "his"
        self.him = "her" if girl else "him"
        self.kindA = "girl" if girl else "boy"
        animal, name = rng.choice(ANIMALS)
        if rng.random() < 0.5:  # the friend is an animal with a name ...
            self.B, self.kindB = name, animal
        else:  # ... or another child
            self.B = rng.choice([n for n in GIRLS + BOYS if n != self.A])
            self.kindB = "girl" if self.B in GIRLS else "boy"
        self.adj, self.obj = rng.choice(ADJ), rng.choice(OBJECTS)
        self.place = rng.choice(PLACES)
        self.n, self.things = rng.choice(NUMBERS), rng.choice(THINGS)

    def fill(self, s: str) -> str:
        r = self.rng
        return s.format(
            A=self.A,
            B=self.B,
            he=self.he,
            He=self.he.capitalize(),
            his=self.his,
            His=self.his.capitalize(),
            him=self.him,
            kindA=self.kindA,
            kindB=self.kindB,
            adj=self.adj,
            obj=self.obj,
            place=self.place,
            n=self.n,
            things=self.things,
            adj2=r.choice(ADJ),
            obj2=r.choice(OBJECTS),
            animal=r.choice(ANIMALS)[0],
            game=r.choice(GAMES),
            bad=r.choice(FEEL_BAD),
            good=r.choice(FEEL_GOOD),
            hide=r.choice(HIDE),
            moral=r.choice(MORALS),
        )


def _middle(c: _Cast, k: int) -> list[str]:
    """k filler sentences: they put distance between an entity's introduction and its recall."""
    return [c.fill(s) for s in c.rng.sample(FILLER, k)]


def _lost(c: _Cast) -> list[str]:
    s = [
        "Once upon a time, there was a little {kindA} named {A}.",
        "{A} had a {adj} {obj}. {He} loved {his} {adj} {obj} very much.",
        "One day, {A} went to the {place} with {his} friend {B}, a {kindB}.",
        "{WEATHER}",
        "They played {game} all day.",
        *_middle(c, c.rng.randint(1, 4)),
        "When the sun began to set, {A} looked for {his} {obj}, but it was gone!",
        "{A} felt {bad}. {He} started to cry.",
        '{B} said, "Don\'t worry, {A}. I will help you find your {obj}."',
        "They looked everywhere in the {place}.",
        "At last, {B} found the {adj} {obj} {hide}.",
        '{A} was so {good}. "Thank you, {B}!" said {A}.',
        "From that day on, {A} always kept the {adj} {obj} safe, and {A} and {B} were best friends.",
    ]
    return s


def _share(c: _Cast) -> list[str]:
    return [
        "Once upon a time, in a small town, there lived a {kindA} named {A}.",
        "{A} had {n} {things} and a {adj} {obj}.",
        "{A} liked to play with the {obj} at the {place}.",
        "One day, {B} the {kindB} came to the {place}. {B} wanted to play with the {obj} too.",
        '"No, it is mine!" said {A}. {B} felt {bad} and walked away.',
        *_middle(c, c.rng.randint(1, 4)),
        "Later, {A} was alone with the {obj}. It was not fun to play alone.",
        '{A} went to find {B} and said, "I am sorry, {B}. Let\'s play with my {obj} together."',
        "{B} smiled. They played with the {adj} {obj} and shared the {n} {things}.",
        "{A} learned that {moral}.",
    ]


def _brave(c: _Cast) -> list[str]:
    return [
        "There was a {kindA} named {A} who was afraid of the dark.",
        "Every night, {A} held {his} {adj} {obj} and hid under {his} bed covers.",
        "One night, {A} heard a noise outside near the {place}.",
        "{WEATHER}",
        "{A} was {bad}, but {he} wanted to see what it was.",
        *_middle(c, c.rng.randint(1, 3)),
        "{A} took the {adj} {obj} and went outside very slowly.",
        "It was {B} the {kindB}! {B} was lost and cold.",
        "{A} was not scared anymore. {He} gave {B} some food and the {adj} {obj} to hold.",
        '{B} said, "You are very brave, {A}." {A} felt {good}.',
        "After that night, {A} was never afraid of the dark again, and {he} told everyone that {moral}.",
    ]


def _gift(c: _Cast) -> list[str]:
    return [
        "Today was a special day. It was the birthday of {B} the {kindB}.",
        "{A} wanted to make a gift for {B}.",
        "{A} found a {adj} {obj} and {n} {things} at the {place}.",
        "{He} put the {things} in a box and tied the {obj} on top.",
        *_middle(c, c.rng.randint(1, 4)),
        "On the way to the party, {A} fell down and the box opened.",
        "Only some of the {things} were left. {A} felt {bad}.",
        "{A} gave the box to {B} anyway. {B} looked at the {adj} {obj} and smiled.",
        '"This is the best gift!" said {B}. "I love the {obj}, and I love you, {A}."',
        "{A} was {good}. {He} learned that a gift from the heart is always enough.",
    ]


def _count(c: _Cast) -> list[str]:
    return [
        "{A} and {B} went to the {place} to find {things}.",
        "{A} had a {adj} {obj} to carry them in.",
        "First they found one. Then they found two more.",
        *_middle(c, c.rng.randint(1, 3)),
        "At the end of the day, they had {n} {things} in the {obj}.",
        '"Let\'s count them again," said {B}. They counted: {n}!',
        "{A} gave some of the {n} {things} to {his} mom.",
        'Mom said, "Thank you, {A}. You and {B} worked very hard."',
        "{A} and {B} were {good}, and they went back to the {place} the next day.",
    ]


TEMPLATES = (_lost, _share, _brave, _gift, _count)


def story(seed: int, index: int) -> str:
    """Story number `index` of the stream with `seed`: a pure function of the two."""
    rng = random.Random(seed * 1_000_003 + index)
    cast = _Cast(rng)
    lines = rng.choice(TEMPLATES)(cast)
    return " ".join(cast.fill(s.replace("{WEATHER}", rng.choice(WEATHER))) for s in lines)


def stories(seed: int = 0, start: int = 0, count: int | None = None) -> Iterator[str]:
    """The stories start, start+1, ... (endless when count is None)."""
    i = start
    while count is None or i < start + count:
        yield story(seed, i)
        i += 1


__all__ = ["LABEL", "stories", "story"]
