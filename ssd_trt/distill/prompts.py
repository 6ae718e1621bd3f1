"""Instruction-style training prompts for distillation, built deterministically from a seed.

The draft must imitate the target on the kind of text it will be asked to speculate on, so the
prompts cover the same five kinds of workload as the benchmark set (code, chat, math word
problems, plain prose continuation, summarisation) without reusing any benchmark prompt: task
lists here are hand-written, and prose/summary passages come from the offline corpora.
The benchmark prompt file (``ssd_trt/bench/prompts/default.jsonl``) is used only for evaluation.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# Share of each kind in the training prompt mix. Chat/code/math get their continuation from the
# target under its chat template; prose is plain continuation (no template), as in the bench.
KIND_WEIGHTS = {"code": 0.2, "chat": 0.25, "math": 0.2, "prose": 0.15, "summarization": 0.2}


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str
    chat: bool  # apply the target's chat template


CODE_TASKS = [
    ("reverse_words", "sentence: str", "str", "reverses the order of the words in a sentence"),
    ("dedupe", "items: list", "list", "removes duplicates from a list while keeping the first occurrence order"),
    ("gcd", "a: int, b: int", "int", "returns the greatest common divisor of two integers"),
    ("lcm", "a: int, b: int", "int", "returns the least common multiple of two positive integers"),
    ("is_prime", "n: int", "bool", "checks whether a number is prime"),
    ("factorial", "n: int", "int", "computes n factorial iteratively"),
    ("celsius_to_fahrenheit", "c: float", "float", "converts a temperature from Celsius to Fahrenheit"),
    ("title_case", "text: str", "str", "capitalises the first letter of every word"),
    ("sum_digits", "n: int", "int", "returns the sum of the decimal digits of a non-negative integer"),
    ("count_words", "text: str", "dict[str, int]", "counts how many times each word appears, ignoring case"),
    ("find_max", "nums: list[int]", "int", "returns the largest number without using max()"),
    ("mean", "values: list[float]", "float", "returns the arithmetic mean and raises ValueError on an empty list"),
    ("median", "values: list[float]", "float", "returns the median of a list of numbers"),
    ("rotate_list", "items: list, k: int", "list", "rotates a list to the right by k positions"),
    ("pairwise_sums", "nums: list[int], target: int", "list[tuple[int, int]]", "returns all index pairs whose values add up to target"),
    ("is_anagram", "a: str, b: str", "bool", "checks whether two strings are anagrams of each other"),
    ("read_csv_column", "path: str, column: str", "list[str]", "reads a CSV file and returns the values of one column"),
    ("merge_dicts", "a: dict, b: dict", "dict", "merges two dictionaries, summing the values of shared keys"),
    ("matrix_multiply", "a: list[list[float]], b: list[list[float]]", "list[list[float]]", "multiplies two matrices"),
    ("bubble_sort", "nums: list[int]", "list[int]", "sorts a list with bubble sort and returns a new list"),
    ("insertion_sort", "nums: list[int]", "list[int]", "sorts a list in place using insertion sort"),
    ("quick_sort", "nums: list[int]", "list[int]", "sorts a list using quicksort"),
    ("power_set", "items: list", "list[list]", "returns every subset of a list"),
    ("permutations", "s: str", "list[str]", "returns all permutations of a string"),
    ("validate_email", "address: str", "bool", "does a simple validity check of an email address"),
    ("roman_to_int", "s: str", "int", "converts a Roman numeral to an integer"),
    ("int_to_binary", "n: int", "str", "converts a non-negative integer to its binary representation"),
    ("count_lines", "path: str", "int", "counts the non-empty lines of a text file"),
    ("char_histogram", "text: str", "dict[str, int]", "counts the occurrences of each letter"),
    ("remove_punctuation", "text: str", "str", "strips punctuation characters from a string"),
    ("longest_word", "sentence: str", "str", "returns the longest word in a sentence"),
    ("digits_to_words", "n: int", "str", "spells out each digit of a number as an English word"),
    ("leap_year", "year: int", "bool", "tells whether a year is a leap year"),
    ("days_between", "start: str, end: str", "int", "returns the number of days between two ISO dates"),
    ("clamp", "x: float, low: float, high: float", "float", "limits a value to a range"),
    ("stack_push_pop", "ops: list[str]", "list[int]", "simulates a stack from push/pop commands and returns the final stack"),
    ("queue_from_stacks", "", "None", "implements a queue using two stacks as a small class"),
    ("dot_product", "a: list[float], b: list[float]", "float", "computes the dot product of two vectors of the same length"),
    ("normalize", "values: list[float]", "list[float]", "scales a list of numbers to the range 0 to 1"),
    ("compress_spaces", "text: str", "str", "replaces runs of whitespace with a single space"),
    ("tree_depth", "node: dict", "int", "returns the depth of a binary tree stored as nested dicts"),
    ("bfs_order", "graph: dict[str, list[str]], start: str", "list[str]", "returns the breadth-first visiting order of a graph"),
    ("dfs_path", "graph: dict[str, list[str]], a: str, b: str", "list[str] | None", "finds a path between two nodes with depth-first search"),
    ("json_keys", "obj: dict", "list[str]", "lists all keys of a nested JSON object, dotted"),
    ("safe_divide", "a: float, b: float", "float | None", "divides two numbers and returns None when dividing by zero"),
    ("histogram_bins", "values: list[float], bins: int", "list[int]", "counts how many values fall in each of equal-width bins"),
    ("string_compress", "s: str", "str", "shortens a string by counting consecutive characters, keeping the original if not shorter"),
    ("matrix_trace", "m: list[list[int]]", "int", "returns the sum of the diagonal of a square matrix"),
    ("top_k", "nums: list[int], k: int", "list[int]", "returns the k largest numbers in descending order"),
    ("unique_chars", "s: str", "bool", "checks whether all characters in a string are different"),
]
CODE_OTHER = [
    "Write a JavaScript function that {d}.",
    "Write a SQL query that {q}.",
    "Explain what the following Python code does:\n\n{snippet}",
    "Find the bug in this Python function and fix it:\n\n{snippet}",
]
SQL_TASKS = [
    "lists the ten most expensive products from a table products(id, name, price)",
    "counts the employees in each department of a table employees(id, name, dept, salary)",
    "finds customers who have never placed an order, given tables customers(id, name) and orders(id, customer_id)",
    "returns the average salary per department, highest first",
    "selects all users who signed up in the last 30 days from users(id, email, created_at)",
    "deletes duplicate rows from a table emails(id, address), keeping the smallest id",
]
SNIPPETS = [
    "def f(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n            out.append(x * x)\n    return out",
    "def avg(nums):\n    total = 0\n    for n in nums:\n        total += n\n    return total / len(nums) + 1",
    "def last(items):\n    return items[len(items)]",
    "def greet(names):\n    return ', '.join('Hello ' + n for n in names)",
    "def count(s, c):\n    n = 0\n    for ch in s:\n        if ch == c:\n            n =+ 1\n    return n",
    "import os\n\ndef sizes(folder):\n    return {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)}",
]

CHAT_TOPICS = [
    "photosynthesis", "the water cycle", "inflation", "black holes", "machine learning", "the stock market",
    "recursion", "the immune system", "gravity", "climate change", "democracy", "electricity",
    "the internet", "DNA", "earthquakes", "supply and demand", "a neural network", "encryption",
    "the French Revolution", "plate tectonics", "the greenhouse effect", "a budget", "cloud computing",
    "meditation", "the Roman Empire", "evolution", "rainbows", "tides", "vitamins", "solar panels",
]
ACTIVITIES = [
    "learning to cook", "saving money", "studying for exams", "sleeping better", "public speaking",
    "staying focused while working from home", "learning to draw", "writing a resume", "gardening",
    "traveling on a budget", "making friends in a new city", "keeping a journal", "learning guitar",
    "reducing stress", "organizing a small kitchen", "training a puppy", "starting a podcast",
]
CHAT_TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is {topic}? Give a short explanation and one example.",
    "Explain {topic} to a twelve-year-old.",
    "Give me {n} tips for {activity}.",
    "What are the most common mistakes people make when {activity}?",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a short story for children about {topic}.",
    "What are the pros and cons of {activity}?",
    "Create a step-by-step plan for {activity}.",
    "Write a friendly email to a coworker asking for help with {activity}.",
    "Compare {topic} and {topic2}. How are they similar and how are they different?",
    "Why is {topic} important? Answer in one paragraph.",
    "Write a short blog post introduction about {activity}.",
    "What does this saying mean? \"{quote}\"",
    "Rewrite the following sentence in plain modern English: \"{sentence}\"",
    "Give a title for a story that begins: \"{sentence}\"",
    "Correct the grammar of this sentence: \"{sentence}\"",
]
NAMES = ["Anna", "Ben", "Carlos", "Dina", "Eli", "Fatima", "George", "Hana", "Ivan", "Julia", "Kofi", "Leo",
         "Mina", "Noah", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
ITEMS = ["apples", "stickers", "books", "cookies", "marbles", "pencils", "stamps", "cards", "oranges", "toy cars"]
MATH_TEMPLATES = [
    "{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {item} does {n1} have now?",
    "A shop sells {item} at {p} dollars each. {n1} buys {a} of them and pays with a {bill}-dollar bill. How much change does {n1} get?",
    "{n1} walks {a} kilometers every day for {b} days. How many kilometers does {n1} walk in total?",
    "A class has {a} students. Each student needs {b} {item}. {item_cap} come in packs of {c}. How many packs are needed?",
    "{n1} is {a} years old. {n2} is {b} years older than {n1}. How old will {n2} be in {c} years?",
    "A car uses {b} liters of fuel for every 100 kilometers. How much fuel does it need for a trip of {d} kilometers?",
    "A rectangle has a length of {a} cm and a width of {b} cm. What are its area and its perimeter?",
    "{n1} saves {b} dollars a week. How many weeks does {n1} need to save {d} dollars?",
    "There are {d} {item} shared equally among {b} children. How many does each child get, and how many are left over?",
    "A price of {d} dollars is increased by {pc} percent. What is the new price?",
    "{n1} reads {a} pages on Monday and twice as many on Tuesday. The book has {d} pages. How many pages are left?",
    "A tank holds {d} liters and is {pc} percent full. How many liters are needed to fill it?",
    "What is {a} times {b} plus {c}? Explain each step.",
    "The sum of two numbers is {d} and their difference is {a}. What are the two numbers?",
    "A train leaves at {h}:00 and travels for {b} hours and {m} minutes. At what time does it arrive?",
]
MATH_SUFFIX = ["", " Show your work step by step.", " Explain your reasoning.", " Think step by step."]
SUMMARY_INSTRUCTIONS = [
    "Summarize the passage above in two sentences.", "Summarize the passage above in one sentence.",
    "Give a brief summary of the text above.", "What is the main idea of the passage above?",
    "Summarize the text above in three bullet points.",
]


def _passage(rng: random.Random, paras: list[str], lo: int, hi: int) -> str | None:
    """A run of consecutive paragraphs with lo..hi words, cut at a sentence end; None if none found."""
    for _ in range(20):
        i = rng.randrange(len(paras))
        words: list[str] = []
        j = i
        while j < len(paras) and len(words) < hi:
            words.extend(paras[j].split())
            j += 1
        if len(words) < lo:
            continue
        text = " ".join(words[:hi])
        cut = max(text.rfind(". ", 0, len(text)), text.rfind("? "), text.rfind("! "))
        if cut > 0 and len(text[:cut + 1].split()) >= lo:
            return text[:cut + 1]
    return None


def _sentence(rng: random.Random, paras: list[str]) -> str:
    for _ in range(50):
        p = rng.choice(paras)
        for s in p.split(". "):
            if 8 <= len(s.split()) <= 30:
                return s.strip().rstrip(".") + "."
    return rng.choice(paras)[:200]


def _code(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.6:
        name, args, ret, desc = rng.choice(CODE_TASKS)
        if rng.random() < 0.5:
            return f"Write a Python function `{name}({args}) -> {ret}` that {desc}."
        return f'def {name}({args}) -> {ret}:\n    """{desc[0].upper() + desc[1:]}."""\n'
    if r < 0.75:
        return CODE_OTHER[0].format(d=rng.choice(CODE_TASKS)[3])
    if r < 0.85:
        return CODE_OTHER[1].format(q=rng.choice(SQL_TASKS))
    return rng.choice(CODE_OTHER[2:]).format(snippet=rng.choice(SNIPPETS))


def _math(rng: random.Random) -> str:
    item = rng.choice(ITEMS)
    n1, n2 = rng.sample(NAMES, 2)
    vals = dict(n1=n1, n2=n2, item=item, item_cap=item[0].upper() + item[1:], a=rng.randint(3, 40),
                b=rng.randint(2, 12), c=rng.randint(2, 9), d=rng.randint(40, 900), p=rng.randint(2, 15),
                bill=rng.choice([20, 50, 100]), pc=rng.choice([10, 15, 20, 25, 30, 40, 50]),
                h=rng.randint(5, 18), m=rng.choice([10, 15, 20, 30, 45]))
    return rng.choice(MATH_TEMPLATES).format(**vals) + rng.choice(MATH_SUFFIX)


def _chat(rng: random.Random, corpora: dict[str, list[str]]) -> str:
    t1, t2 = rng.sample(CHAT_TOPICS, 2)
    quote = rng.choice(corpora["fortunes"]).replace("\n", " ").replace("\t", " ")
    quote = " ".join(quote.split()[:40])
    return rng.choice(CHAT_TEMPLATES).format(
        topic=t1, topic2=t2, activity=rng.choice(ACTIVITIES), n=rng.choice([3, 4, 5]),
        quote=quote, sentence=_sentence(rng, corpora[rng.choice(["austen", "brown"])]))


def build_prompts(corpora: dict[str, list[str]], n: int, seed: int) -> list[Prompt]:
    """``n`` training prompts drawn with ``random.Random(seed)``; same inputs, same list."""
    if n <= 0:
        raise ValueError(f"number of prompts must be positive, got {n}")
    rng = random.Random(seed)
    kinds, weights = zip(*KIND_WEIGHTS.items())
    prose_src = [c for c in ("austen", "brown", "nlp") if corpora.get(c)]
    out: list[Prompt] = []
    while len(out) < n:
        kind = rng.choices(kinds, weights)[0]
        if kind == "code":
            out.append(Prompt(kind, _code(rng), True))
        elif kind == "math":
            out.append(Prompt(kind, _math(rng), True))
        elif kind == "chat":
            out.append(Prompt(kind, _chat(rng, corpora), True))
        elif kind == "prose":
            text = _passage(rng, corpora[rng.choice(prose_src)], 15, 60)
            if text:
                out.append(Prompt(kind, text, False))
        else:
            text = _passage(rng, corpora[rng.choice(prose_src)], 80, 130)
            if text:
                out.append(Prompt(kind, text + "\n\n" + rng.choice(SUMMARY_INSTRUCTIONS), True))
    return out
