"""Generate the project's own sample corpus in WikiText format (no text taken from anywhere).

A seeded generator invents a small world (regions, towns, rivers, people, species, ships and
albums, each with fixed facts), then writes one encyclopedia-style article per entity from
sentence templates and small word lists of its own. Facts repeat inside an article and across
articles (a person's birthplace is a town with its own article), so a small language model has
real structure to learn and its loss falls clearly.

The output follows the WikiText "tokens" layout: ` = Title = ` headings, ` = = Section = = `
subheadings, ` = = = Sub = = = ` below them, a blank line around each heading, one paragraph per
line, a leading and trailing space on every line, punctuation split off by spaces, and the
` @-@ `, ` @,@ `, ` @.@ ` escapes for hyphens, thousands separators and decimal points.

    python data/make_sample_corpus.py                  # rewrites data/wikitext-sample/
    python data/make_sample_corpus.py --out DIR --seed 1234

Only `random.Random` methods whose streams are stable across Python 3 versions are used, and no
set or dict is iterated for ordering, so the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

SEED, SCALE = 1234, 32  # what data/wikitext-sample was generated with
ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "ch",
    "sh",
    "bl",
    "cl",
]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea", "ou"]
CODAS = ["", "", "", "", "", "n", "r", "l", "s", "th", "nd", "rk", "m", "ck", "ll", "ss", "rn"]
TOWN_SUFFIXES = ["ford", "bury", "ton", "wick", "dale", "mouth", "field", "by", "stead", "ham", "more", "haven"]
FIRST_NAMES = [
    "Alden",
    "Bera",
    "Corin",
    "Dara",
    "Edric",
    "Fenna",
    "Galen",
    "Hilde",
    "Ivo",
    "Jorun",
    "Kestrel",
    "Liane",
    "Maren",
    "Nils",
    "Odette",
    "Perrin",
    "Quill",
    "Rosa",
    "Soren",
    "Talia",
    "Ulric",
    "Vera",
    "Wendel",
    "Yselde",
    "Anselm",
    "Brida",
    "Cosmo",
    "Delphine",
    "Emeric",
    "Flora",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
INDUSTRIES = [
    "wool",
    "shipbuilding",
    "brewing",
    "glassmaking",
    "coal mining",
    "fishing",
    "paper milling",
    "clockmaking",
    "salt production",
    "textiles",
    "pottery",
    "timber",
]
LANDMARKS = ["cathedral", "castle", "bridge", "market hall", "abbey", "lighthouse", "town hall", "observatory"]
PROFESSIONS = [
    ("painter", "paintings", "gallery"),
    ("poet", "poems", "anthology"),
    ("composer", "symphonies", "concert hall"),
    ("architect", "buildings", "academy"),
    ("botanist", "studies", "herbarium"),
    ("engineer", "bridges", "institute"),
    ("novelist", "novels", "publishing house"),
    ("astronomer", "catalogues", "observatory"),
]
ANIMALS = [
    ("bird", "wingspan", "nests", "seeds and insects"),
    ("beetle", "body length", "burrows", "decaying wood"),
    ("fish", "body length", "spawning grounds", "small crustaceans"),
    ("frog", "body length", "breeding ponds", "flies and worms"),
    ("moth", "wingspan", "host plants", "nectar"),
]
HABITATS = [
    "wet meadows",
    "pine forests",
    "rocky coasts",
    "slow rivers",
    "upland heath",
    "reed beds",
    "chalk grassland",
    "mountain lakes",
]
STATUSES = ["least concern", "near threatened", "vulnerable", "endangered"]
COLOURS = ["brown", "grey", "green", "black", "pale yellow", "dark red", "blue", "white"]
SHIP_KINDS = ["cargo ship", "steam frigate", "passenger liner", "survey vessel", "ferry", "schooner"]
FATES = [
    "was broken up for scrap",
    "sank in a storm",
    "was sold to a foreign owner",
    "was preserved as a museum ship",
    "ran aground and was abandoned",
]
GENRES = ["folk", "rock", "jazz", "electronic", "pop", "blues"]
ADJECTIVES = [
    "small",
    "large",
    "old",
    "narrow",
    "broad",
    "quiet",
    "busy",
    "famous",
    "modest",
    "remote",
    "ancient",
    "new",
    "wealthy",
    "rural",
]
NOUNS = [
    "school",
    "church",
    "library",
    "mill",
    "harbour",
    "railway station",
    "market",
    "museum",
    "park",
    "theatre",
    "hospital",
    "inn",
    "farm",
    "quarry",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
STARS = ["two", "three", "four", "five"]


def num(n: int) -> str:
    """Write an integer the WikiText way: 12345 -> '12 @,@ 345'."""
    s = f"{n:,}"
    return s.replace(",", " @,@ ")


def dec(x: float) -> str:
    """Write a one-decimal number the WikiText way: 3.5 -> '3 @.@ 5'."""
    return f"{x:.1f}".replace(".", " @.@ ")


class World:
    """All entities and their fixed facts, drawn once from one seeded generator."""

    def __init__(self, seed: int, scale: int) -> None:
        self.rng = r = random.Random(seed)
        self.used: list[str] = []
        self.countries = [self.word(2, 2) + r.choice(["ia", "land", "mark"]) for _ in range(4)]
        self.regions = [
            {
                "name": self.word(2, 3),
                "country": self.countries[i % 4],
                "capital": self.word(1, 2) + r.choice(TOWN_SUFFIXES),
            }
            for i in range(10)
        ]
        self.seas = [f"{self.word(2, 2)} Sea" for _ in range(4)]
        self.mountains = [f"Mount {self.word(2, 3)}" for _ in range(12)]
        self.rivers = [
            {
                "name": self.word(1, 2),
                "length": r.randint(40, 900),
                "source": r.choice(self.mountains),
                "mouth": r.choice(self.seas),
                "region": r.choice(self.regions),
                "towns": [],
                "tributaries": [(self.word(1, 2), r.randint(5, 120)) for _ in range(r.randint(2, 4))],
                "flood": r.randint(1700, 2000),
                "bridges": r.randint(3, 60),
            }
            for _ in range(3 * scale)
        ]
        self.towns = []
        for _ in range(12 * scale):
            river = r.choice(self.rivers)
            town = {
                "name": self.word(1, 2) + r.choice(TOWN_SUFFIXES),
                "people": [],
                "region": river["region"],
                "river": river,
                "population": r.randint(800, 250000),
                "founded": r.randint(900, 1750),
                "elevation": r.randint(5, 1400),
                "industry": r.choice(INDUSTRIES),
                "landmark": r.choice(LANDMARKS),
                "founder": self.person_name(),
                "railway": r.randint(1835, 1910),
                "market": r.choice(WEEKDAYS),
                "festival": r.choice(MONTHS),
                "schools": r.randint(1, 40),
            }
            river["towns"].append(town)
            self.towns.append(town)
        n_towns = len(self.towns)
        for i, town in enumerate(self.towns):  # twinned with any other town
            town["twin"] = self.towns[(i + r.randint(1, n_towns - 1)) % n_towns]["name"]
        self.people = []
        for _ in range(8 * scale):
            born = r.randint(1700, 1950)
            person = {
                "name": self.person_name(),
                "born": born,
                "died": born + r.randint(35, 95),
                "town": r.choice(self.towns),
                "prof": r.choice(PROFESSIONS),
                "works": r.randint(6, 140),
                "teacher": self.person_name(),
                "month": r.choice(MONTHS),
                "day": r.randint(1, 28),
                "spouse": self.person_name(),
                "children": r.randint(0, 6),
                "titles": [
                    (f"{r.choice(ADJECTIVES).capitalize()} {self.word(1, 2)}", born + r.randint(20, 34))
                    for _ in range(r.randint(2, 5))
                ],
            }
            person["town"]["people"].append(person["name"])
            self.people.append(person)
        self.species = [
            {
                "genus": self.word(2, 3),
                "common": f"{r.choice(COLOURS)} {self.word(1, 2).lower()}",
                "epithet": self.word(2, 2).lower() + r.choice(["us", "a", "is", "um"]),
                "kind": r.choice(ANIMALS),
                "size": r.randint(8, 450) / 10,
                "habitat": r.choice(HABITATS),
                "status": r.choice(STATUSES),
                "region": r.choice(self.regions),
                "year": r.randint(1760, 1990),
                "author": self.person_name(),
                "colour": r.choice(COLOURS),
                "eggs": r.randint(2, 40),
                "life": r.randint(2, 30),
            }
            for _ in range(4 * scale)
        ]
        self.ships = [
            {
                "name": self.word(2, 3),
                "kind": r.choice(SHIP_KINDS),
                "launched": r.randint(1820, 1960),
                "port": r.choice(self.towns),
                "tons": r.randint(300, 40000),
                "length": r.randint(30, 280),
                "crew": r.randint(12, 900),
                "fate": r.choice(FATES),
                "years": r.randint(4, 50),
                "builder": f"{self.word(1, 2)} and Sons",
                "knots": r.randint(80, 260) / 10,
            }
            for _ in range(2 * scale)
        ]
        self.albums = [
            {
                "title": f"{r.choice(ADJECTIVES).capitalize()} {self.word(1, 2)}",
                "band": f"The {self.word(2, 2)}s",
                "year": r.randint(1962, 2015),
                "genre": r.choice(GENRES),
                "town": r.choice(self.towns),
                "chart": r.randint(1, 60),
                "weeks": r.randint(2, 40),
                "tracks": [self.word(1, 3) for _ in range(r.randint(6, 11))],
                "producer": self.person_name(),
                "stars": r.choice(STARS),
            }
            for _ in range(2 * scale)
        ]

    def word(self, lo: int, hi: int) -> str:
        """Invent a capitalised name of lo..hi syllables, never the same twice."""
        while True:
            w = "".join(
                self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                for _ in range(self.rng.randint(lo, hi))
            )
            w = w.capitalize()
            if w not in self.used and len(w) > 2:
                self.used.append(w)
                return w

    def person_name(self) -> str:
        """Invent a first name + surname."""
        return f"{self.rng.choice(FIRST_NAMES)} {self.word(2, 2)}"


def a_an(word: str) -> str:
    """'a painter', 'an engineer'."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def pick(rng: random.Random, options: list[str], k: int) -> list[str]:
    """k distinct templates in random order (all of them when k >= len)."""
    return rng.sample(options, min(k, len(options)))


def filler(rng: random.Random, place: str) -> str:
    """A generic sentence about a place, for vocabulary beyond the fixed facts."""
    adj, noun = rng.choice(ADJECTIVES), rng.choice(NOUNS)
    noun2 = "<unk>" if rng.random() < 0.03 else rng.choice([x for x in NOUNS if x != noun])
    year = rng.randint(1800, 2005)
    return rng.choice(
        [
            f"In {year} a {adj} {noun} was opened in {place} .",
            f"The {noun} in {place} was rebuilt in {year} after a fire .",
            f"A {adj} {noun} stood beside the {noun2} until {year} .",
            f"By {year} the {noun} had become the most visited building in {place} .",
            f"Local records from {year} describe the {noun} as {adj} and well @-@ kept .",
            f"The {noun2} near {place} was closed in {year} and later turned into a {noun} .",
            f"The {adj} {noun} of {place} appears on a map drawn in {year} .",
        ]
    )


Sections = list[tuple[str, list[str]]]


def town_article(w: World, t: dict) -> Sections:
    r, n, reg, riv = w.rng, t["name"], t["region"], t["river"]
    river, pop = riv["name"], num(t["population"])
    size = "city" if t["population"] > 100000 else "town" if t["population"] > 5000 else "village"
    others = [o["name"] for o in riv["towns"] if o is not t][:3]
    intro = [
        f"{n} is a {size} in {reg['name']} , {reg['country']} , on the banks of the River {river} .",
        f"It had a population of {pop} at the last census .",
        f"{n} is known for its {t['landmark']} and for its long history of {t['industry']} .",
    ]
    hist = pick(
        r,
        [
            f"{n} was founded in {t['founded']} by {t['founder']} .",
            f"The first settlement at {n} grew around a ford on the River {river} .",
            f"In the {t['founded'] // 100 + 1}th century {n} received a market charter .",
            f"The {t['landmark']} of {n} was begun soon after {t['founded']} .",
            f"{t['founder']} is remembered in {n} as the founder of the {size} .",
            f"The River {river} flooded {n} in {riv['flood']} .",
        ],
        5,
    )
    geo = pick(
        r,
        [
            f"{n} lies at an elevation of {num(t['elevation'])} metres ( "
            f"{num(round(t['elevation'] * 3.281))} ft ) above sea level .",
            f"The River {river} flows through the centre of {n} .",
            f"{n} is {r.randint(3, 90)} kilometres from {reg['capital']} , the capital of {reg['name']} .",
            f"The land around {n} is mostly farmland and {r.choice(HABITATS)} .",
        ],
        4,
    )
    econ = pick(
        r,
        [
            f"The economy of {n} has long depended on {t['industry']} .",
            f"{t['industry'].capitalize()} employed about {num(t['population'] // 7)} people in {n} at its peak .",
            f"Today tourism to the {t['landmark']} is also important to {n} .",
            f"A market is held in {n} every {t['market']} .",
            f"The {t['industry']} trade made {n} one of the richest places in {reg['name']} .",
        ],
        4,
    )
    demo = [
        f"At the last census {n} had {pop} inhabitants .",
        f"The population of {n} grew by {dec(r.randint(5, 200) / 10)} per cent in ten years .",
        f"There are {t['schools']} schools in {n} .",
    ]
    culture = [f"A festival is held in {n} every {t['festival']} .", f"{n} is twinned with {t['twin']} ."] + [
        filler(r, n) for _ in range(3)
    ]
    transport = [f"The railway reached {n} in {t['railway']} ."]
    transport += [f"A road along the River {river} links {n} with {o} ." for o in others]
    people = [f"{p} was born in {n} ." for p in t["people"]] or [f"{n} is the home of the {t['landmark']} ."]
    return [
        ("", intro),
        ("History", hist + [filler(r, n)]),
        ("Geography", geo),
        ("Economy", econ),
        ("Demographics", demo),
        ("Culture", culture),
        ("Transport", transport),
        ("Notable people", people),
    ]


def river_article(w: World, v: dict) -> Sections:
    r, n, km = w.rng, v["name"], v["length"]
    towns = [t["name"] for t in v["towns"]]
    intro = [
        f"The River {n} is a river in {v['region']['name']} , {v['region']['country']} .",
        f"It is {num(km)} kilometres ( {num(round(km * 0.6214))} mi ) long .",
    ]
    course = [
        f"The {n} rises on the slopes of {v['source']} and flows into the {v['mouth']} .",
        f"From {v['source']} the {n} runs for {num(km)} kilometres to the {v['mouth']} .",
    ]
    tribs = [f"The {a} joins the {n} after {num(b)} kilometres ." for a, b in v["tributaries"]]
    settle = (
        [
            f"The largest settlements on the {n} are {' , '.join(towns[:-1])} and {towns[-1]} ."
            if len(towns) > 1
            else f"The only town on the {n} is {towns[0]} ."
        ]
        if towns
        else [f"No large town stands on the {n} ."]
    )
    settle += [f"{d['name']} lies on the {n} and is known for {d['industry']} ." for d in v["towns"][:5]]
    eco = pick(
        r,
        [
            f"The {n} is home to many fish and to the {r.choice(COLOURS)} heron .",
            f"Parts of the {n} valley are protected as nature reserves .",
            f"The water of the {n} is clean along most of its length .",
        ],
        3,
    )
    hist = [
        f"The {n} has {v['bridges']} bridges .",
        f"In {v['flood']} the {n} flooded after heavy rain in the hills .",
        f"Mills once stood along the {n} near {r.choice(towns) if towns else v['source']} .",
    ]
    return [
        ("", intro),
        ("Course", course),
        ("Tributaries", tribs),
        ("Settlements", settle),
        ("Ecology", eco),
        ("History", hist),
    ]


def person_article(w: World, p: dict) -> Sections:
    r, n, town = w.rng, p["name"], p["town"]
    job, works, place = p["prof"]
    last = n.split()[1]
    intro = [
        f"{n} ( {p['day']} {p['month']} {p['born']} – {p['died']} ) was {a_an(job)} from "
        f"{town['name']} in {town['region']['name']} .",
        f"{last} is best known for the {works} of the years after {p['titles'][0][1]} .",
    ]
    early = pick(
        r,
        [
            f"{last} was born on {p['day']} {p['month']} {p['born']} in "
            f"{town['name']} , a {r.choice(ADJECTIVES)} place on the River "
            f"{town['river']['name']} .",
            f"As a child {last} studied with {p['teacher']} .",
            f"{last} 's family worked in the {town['industry']} trade of {town['name']} .",
        ],
        3,
    )
    career = pick(
        r,
        [
            f"In {p['born'] + r.randint(18, 30)} {last} moved to the capital of {town['region']['country']} .",
            f"{last} produced {p['works']} {works} in a career of {p['died'] - p['born'] - 20} years .",
            f"The {place} of {town['region']['name']} holds many of {last} 's {works} .",
            f"Critics called the {works} of {last} {r.choice(ADJECTIVES)} and well @-@ made .",
        ],
        4,
    )
    listing = [
        f'" {title} " ( {year} ) is one of the best @-@ known {works} by {last} .' for title, year in p["titles"]
    ]
    personal = [
        f"{last} married {p['spouse']} in {p['born'] + r.randint(20, 34)} .",
        f"They had {p['children']} children ." if p["children"] != 1 else "They had one child .",
    ]
    legacy = [
        f"{last} died in {p['died']} in {town['name']} .",
        f"A {r.choice(NOUNS)} in {town['name']} is named after {n} .",
    ]
    return [
        ("", intro),
        ("Biography", []),
        ("= Early life", early),
        ("= Career", career),
        ("Works", listing),
        ("Personal life", personal),
        ("Legacy", legacy),
    ]


def species_article(w: World, s: dict) -> Sections:
    r, kind = w.rng, s["kind"]
    full, short = f"{s['genus']} {s['epithet']}", f"{s['genus'][0]}. {s['epithet']}"
    intro = [
        f"{full} , known as the {s['common']} , is a species of {kind[0]} found in {s['region']['name']} .",
        f"It was described by {s['author']} in {s['year']} .",
    ]
    tax = [
        f"{s['author']} named {full} in {s['year']} from a specimen taken in {s['region']['name']} .",
        f"The genus {s['genus']} has {r.randint(2, 30)} species .",
    ]
    desc = pick(
        r,
        [
            f"{short} has a {kind[1]} of {dec(s['size'])} cm ( {dec(s['size'] / 2.54)} in ) .",
            f"The upper side of {short} is {s['colour']} and the lower side is {r.choice(COLOURS)} .",
            f"Young {kind[0]}s of this species are paler than the adults .",
        ],
        3,
    )
    dist = [
        f"{short} lives in {s['habitat']} across {s['region']['name']} .",
        f"It is common in {s['habitat']} but rare elsewhere in {s['region']['country']} .",
    ]
    beh = pick(
        r,
        [
            f"{short} feeds on {kind[3]} .",
            f"It makes {kind[2]} in {s['habitat']} in spring .",
            f"A female lays up to {s['eggs']} eggs at a time .",
            f"{short} can live for {s['life']} years .",
            f"{short} is most active at {r.choice(['dawn', 'dusk', 'night', 'noon'])} .",
        ],
        5,
    )
    cons = [
        f"The {s['common']} is listed as {s['status']} .",
        f"Loss of {s['habitat']} is the main threat to {short} .",
    ]
    return [
        ("", intro),
        ("Taxonomy", tax),
        ("Description", desc),
        ("Distribution and habitat", dist),
        ("Behaviour", beh),
        ("Conservation", cons),
    ]


def ship_article(w: World, s: dict) -> Sections:
    r, n, port = w.rng, s["name"], s["port"]["name"]
    intro = [
        f"SS {n} was a {s['kind']} launched at {port} in {s['launched']} .",
        f"She served for {s['years']} years before she {s['fate']} .",
    ]
    design = [
        f"{n} was {num(s['length'])} metres ( {num(round(s['length'] * 3.281))} ft ) long "
        f"and measured {num(s['tons'])} gross tons .",
        f"She carried a crew of {num(s['crew'])} and could make {dec(s['knots'])} knots .",
    ]
    build = [
        f"{n} was built by {s['builder']} at {port} .",
        f"Her keel was laid in {s['launched'] - 1} and she was launched in {s['launched']} .",
    ]
    service = pick(
        r,
        [
            f"{n} sailed from {port} on her first voyage in {s['launched'] + 1} .",
            f"During her {s['years']} years at sea {n} made many voyages to {r.choice(w.towns)['name']} .",
            f"In {s['launched'] + r.randint(1, max(1, s['years']))} {n} was refitted at {port} .",
        ],
        3,
    )
    fate = [f"After {s['years']} years of service {n} {s['fate']} ."]
    return [("", intro), ("Design", design), ("Construction", build), ("Service history", service), ("Fate", fate)]


def album_article(w: World, a: dict) -> Sections:
    r, t, band = w.rng, a["title"], a["band"]
    intro = [
        f"{t} is a {a['genre']} album by {band} , released in {a['year']} .",
        f"It reached number {a['chart']} on the album chart .",
    ]
    rec = pick(
        r,
        [
            f"{band} recorded {t} in {a['town']['name']} with the producer {a['producer']} .",
            f"Recording of {t} took {r.randint(2, 30)} weeks in {a['year'] - 1} .",
            f"{a['producer']} gave {t} a {r.choice(ADJECTIVES)} , {a['genre']} sound .",
        ],
        3,
    )
    rel = [
        f"{t} was released in {a['year']} and spent {a['weeks']} weeks on the chart , peaking at number {a['chart']} .",
        f'" {a["tracks"][0]} " was released as the first single from {t} .',
    ]
    rec2 = [
        f"Critics gave {t} {a['stars']} out of five stars .",
        f"One review called {t} the most {r.choice(ADJECTIVES)} {a['genre']} album of {a['year']} .",
    ]
    tracks = [f'{i + 1} . " {name} "' for i, name in enumerate(a["tracks"])]
    return [
        ("", intro),
        ("Recording", rec),
        ("Release", rel),
        ("Reception", rec2),
        ("Track listing", [" ".join(tracks)]),
    ]


def render(title: str, sections: Sections, rng: random.Random) -> str:
    """Lay out one article the WikiText way; a heading '= X' is one level deeper.
    A section's sentences become paragraphs (one per line) of 2 to 4 sentences."""
    out = [" \n", f" = {title} = \n", " \n"]
    for heading, sentences in sections:
        if heading:
            level = 2 + heading.count("= ")
            marks = " ".join(["="] * level)
            out += [" \n", f" {marks} {heading.replace('= ', '')} {marks} \n", " \n"]
        i = 0
        while i < len(sentences):
            k = rng.randint(2, 4)
            out.append(" " + " ".join(sentences[i : i + k]) + " \n")
            i += k
    return "".join(out)


def build(seed: int, scale: int) -> list[str]:
    """All articles, in a seeded order that mixes the kinds."""
    w = World(seed, scale)
    jobs = (
        [(t["name"], town_article, t) for t in w.towns]
        + [(f"River {v['name']}", river_article, v) for v in w.rivers]
        + [(p["name"], person_article, p) for p in w.people]
        + [(f"{s['genus']} {s['epithet']}", species_article, s) for s in w.species]
        + [(f"SS {s['name']}", ship_article, s) for s in w.ships]
        + [(f"{a['title']} ( album )", album_article, a) for a in w.albums]
    )
    w.rng.shuffle(jobs)
    return [render(title, fn(w, entity), w.rng) for title, fn, entity in jobs]


def write_splits(out_dir: Path, articles: list[str]) -> dict[str, int]:
    """Every 20th article goes to valid, the next-to-every-20th to test: 90/5/5 by article.
    Files are written to a temporary name and renamed when complete."""
    splits = {"train": [], "valid": [], "test": []}
    for i, art in enumerate(articles):
        key = "valid" if i % 20 == 9 else "test" if i % 20 == 19 else "train"
        splits[key].append(art)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for key, arts in splits.items():
        path = out_dir / f"wiki.{key}.tokens"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(arts), encoding="utf-8")
        os.replace(tmp, path)
        sizes[key] = path.stat().st_size
    return sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "wikitext-sample"),
        help="output directory (default: data/wikitext-sample next to this script)",
    )
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--scale", type=int, default=SCALE, help="entities per kind grow with this")
    args = p.parse_args()
    sizes = write_splits(Path(args.out), build(args.seed, args.scale))
    for key, n in sizes.items():
        print(f"{args.out}/wiki.{key}.tokens: {n} bytes")


if __name__ == "__main__":
    main()
