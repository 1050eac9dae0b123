"""Chat prompts for the draft head's training data: task families with slots, follow-up turns, tool requests.

Each family is a few phrasings with slots ({concept}, {pair}, {n}, ...) filled from the lists below; every
combination is one distinct prompt. `chat_prompts` deals the families round-robin, so any prefix of the list
(what a data-size study trains on) has every family in it. None of these is one of the questions
specdec/datasets.py measures chat acceptance on (tests check it).
"""
from __future__ import annotations

import itertools
import random

# the first head's chat prompts: task templates x topics
TOPIC_TASKS = ("Explain {t} to a beginner.", "Write a short story about {t}.", "Give five tips about {t}.",
               "What are common mistakes people make with {t}?", "Summarize the history of {t}.",
               "Write a haiku about {t}.", "Compare {t} with a related idea.", "Describe a typical day involving {t}.",
               "List the pros and cons of {t}.", "Write a product description for something related to {t}.",
               "Answer as a JSON object with keys summary and keywords: what is {t}?",
               "Write Python code that models {t} with a small class.", "Write an email asking a colleague about {t}.",
               "Give a step-by-step guide to getting started with {t}.", "Write three quiz questions about {t}.",
               "Explain {t} in one paragraph, then give an example.",
               "What should I know before investing time in {t}?",
               "Write a tweet about {t}.", "Draft a meeting agenda about {t}.", "Define five key terms related to {t}.",
               "Write a JSON list of three facts about {t}.", "Describe {t} to a ten-year-old.",
               "Write a short dialogue between two people discussing {t}.", "Suggest a weekend project involving {t}.")
TOPICS = ("photosynthesis", "the stock market", "machine learning", "gardening", "the French revolution",
                "climate change", "black holes", "jazz music", "sourdough bread", "electric cars", "the immune system",
                "chess openings", "remote work", "volcanoes", "the internet", "marathon training", "coffee",
                "quantum computing", "bees", "public speaking", "databases", "the Roman empire", "sleep", "recycling",
                "video games", "oceans", "budgeting", "solar panels", "dinosaurs", "learning a language",
                "weather APIs",
                "booking flights", "calendar scheduling", "unit conversion", "recipes", "password security",
                "shipping packages", "hotel reservations", "currency exchange", "sports scores", "music playlists",
                "git branches", "kubernetes", "REST APIs", "spreadsheets", "email marketing", "customer support",
                "home insurance", "time zones", "invoices", "stock tickers", "movie recommendations",
                "restaurant orders", "fitness tracking", "smart home devices", "translation", "news headlines",
                "job interviews", "mortgages",
                "car maintenance", "birdwatching", "knitting", "photography", "podcasts", "board games", "mountains",
                "rivers", "ancient Egypt", "the moon landing", "vaccines", "nutrition", "meditation", "cybersecurity",
                "open source software", "cloud storage", "weather forecasts", "traffic", "electric grids", "batteries")
CONCEPTS = (
    "inflation", "compound interest", "photosynthesis", "natural selection", "plate tectonics", "the water cycle",
    "supply and demand", "machine learning", "public-key cryptography", "blockchains", "vaccines", "antibiotics",
    "black holes", "gravity", "electricity", "magnetism", "nuclear fusion", "the greenhouse effect", "DNA",
    "the immune system", "neural networks", "cloud computing", "containers", "version control", "recursion",
    "object-oriented programming", "garbage collection", "the placebo effect", "opportunity cost", "democracy",
    "the scientific method", "entropy", "relativity", "quantum entanglement", "interest rates", "credit scores",
    "index funds", "carbon offsets", "renewable energy", "3D printing", "GPS", "Wi-Fi", "search engines",
    "the stock market", "cognitive biases", "habit formation", "circadian rhythms", "metabolism", "tides",
    "seasons", "rainbows", "earthquakes", "hurricanes", "coral reefs", "bee pollination", "fermentation",
    "the printing press", "the Renaissance", "the Industrial Revolution", "the Cold War", "the Silk Road",
    "game theory", "probability", "statistics", "prime numbers", "the Pythagorean theorem", "calculus",
    "binary numbers", "encryption", "HTTP", "DNS", "databases", "APIs", "operating systems", "compilers",
    "caching", "load balancing", "unit testing", "agile development", "copyright", "taxes", "insurance",
    "mortgages", "budgeting", "minimalism", "stoicism", "meditation", "sleep cycles", "muscle growth")
PAIRS = (
    ("Python", "JavaScript"), ("SQL", "NoSQL databases"), ("renting", "buying a home"), ("stocks", "bonds"),
    ("a Roth IRA", "a traditional IRA"), ("cats", "dogs as pets"), ("running", "swimming"), ("tea", "coffee"),
    ("electric cars", "hybrid cars"), ("Linux", "Windows"), ("Git merge", "Git rebase"), ("RAM", "storage"),
    ("weather", "climate"), ("viruses", "bacteria"), ("a virus", "a worm in computing"), ("HTTP", "HTTPS"),
    ("machine learning", "traditional programming"), ("capitalism", "socialism"), ("baking soda", "baking powder"),
    ("a credit card", "a debit card"), ("freelancing", "a salaried job"), ("React", "Vue"), ("REST", "GraphQL"),
    ("solar power", "wind power"), ("an ebook", "a printed book"), ("yoga", "pilates"), ("butter", "margarine"),
    ("an LLC", "a sole proprietorship"), ("mitosis", "meiosis"), ("weather forecasts", "climate models"),
    ("a laptop", "a desktop"), ("TCP", "QUIC"), ("threads", "processes"), ("Docker", "virtual machines"),
    ("mutual funds", "ETFs"), ("baroque", "classical music"), ("a résumé", "a CV"), ("alligators", "crocodiles"),
    ("affect", "effect"), ("empathy", "sympathy"), ("speed", "velocity"), ("mass", "weight"), ("a lake", "a pond"))
GOALS = (
    "saving money on groceries", "learning to code", "staying focused while working from home", "running a 5k",
    "public speaking", "writing a novel", "keeping houseplants alive", "learning a new language", "eating healthier",
    "getting better sleep", "reducing screen time", "preparing for a job interview", "networking at conferences",
    "starting a small business", "paying off debt", "taking better photos with a phone", "learning the guitar",
    "studying for exams", "making friends in a new city", "staying motivated at the gym", "reading more books",
    "organizing a small kitchen", "traveling on a budget", "reducing stress", "writing clear emails",
    "giving feedback to a coworker", "managing a remote team", "raising a puppy", "composting at home",
    "learning to cook", "negotiating a salary", "keeping a journal", "improving handwriting", "camping with kids")
TASKS = (
    "change a flat tire", "set up a home Wi-Fi network", "make a budget spreadsheet", "write a cover letter",
    "back up my phone", "clean a cast-iron pan", "plant tomatoes", "tie a tie", "brew pour-over coffee",
    "set up a Python virtual environment", "create a strong password", "file a tax return", "jump-start a car",
    "unclog a drain", "paint a room", "train for a half marathon", "write a haiku", "start a podcast",
    "make a website", "fix a squeaky door", "learn touch typing", "prepare for a power outage", "bake bread",
    "iron a shirt", "sharpen a kitchen knife", "make a paper airplane", "meal prep for a week", "hang a picture")
PHENOMENA = (
    "do leaves change color in autumn", "is the ocean salty", "do we dream", "does ice float", "do cats purr",
    "do onions make you cry", "is the sunset red", "do we get goosebumps", "do birds migrate", "does bread go stale",
    "do we yawn", "do stars twinkle", "does metal feel colder than wood", "do planes leave white trails",
    "is the Dead Sea so salty", "does popcorn pop", "do bubbles form in boiling water", "do we have fingerprints",
    "do cats land on their feet", "does the moon change shape", "do zebras have stripes", "does thunder rumble")
THINGS = (
    "the ocean", "a rainy morning", "city lights", "an old bicycle", "the first snow", "a lighthouse", "coffee",
    "a cat asleep in the sun", "friendship", "the moon", "a train journey", "spring flowers", "a mountain lake",
    "a library", "homework", "a thunderstorm", "time", "a garden", "a lost key", "the night sky", "a kite",
    "a grandmother's kitchen", "a robot learning to paint", "the last day of summer", "a busy market")
WORKS = (
    "Hamlet", "Pride and Prejudice", "Moby-Dick", "The Odyssey", "Frankenstein", "1984", "The Great Gatsby",
    "To Kill a Mockingbird", "Macbeth", "Don Quixote", "The Little Prince", "Jane Eyre", "Brave New World",
    "The Hobbit", "Les Misérables", "A Christmas Carol", "Alice in Wonderland", "The Old Man and the Sea")
CITIES = (
    "Paris", "Tokyo", "Barcelona", "Lisbon", "New York", "Kyoto", "Istanbul", "Mexico City", "Cape Town", "Prague",
    "Vienna", "Buenos Aires", "Amsterdam", "Seoul", "Marrakech", "Edinburgh", "Sydney", "Vancouver", "Hanoi")
DISHES = (
    "pancakes", "a vegetable curry", "guacamole", "fried rice", "a Greek salad", "lentil soup", "banana bread",
    "chicken stir-fry", "shakshuka", "homemade pizza", "risotto", "hummus", "chocolate chip cookies", "ramen",
    "a French omelette", "tacos", "minestrone", "apple crumble", "pad thai", "falafel", "mashed potatoes")
FUNCTIONS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text", "merges two sorted lists",
    "removes duplicates from a list while keeping order", "computes the factorial of n", "flattens a nested list",
    "finds the most common element in a list", "converts Celsius to Fahrenheit", "validates an email address",
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
    "groups words by their first letter", "parses a date string in YYYY-MM-DD format",
    "computes the average of a list of numbers", "chunks a list into pairs",
    "finds all anagrams of a word in a list", "reads a CSV file into a list of dictionaries", "sums the digits of n",
    "capitalizes every word in a sentence", "returns the intersection of two lists", "rotates a list by k places")
LANGS = ("Python", "JavaScript", "Go", "Rust", "Java", "C", "TypeScript", "SQL")
SENTENCES = (
    "the meeting got moved to next week because nobody could make it", "i think we should of left earlier",
    "Our product is good and customers like it a lot", "The weather is nice today so lets go outside",
    "can you send me the report by friday", "He don't know where the keys is", "The project was finished on time",
    "we are very excited to announce our new app", "Please let me know if you have any questions",
    "The train was late again this morning", "i loved the book but the ending was confusing")
RECIPIENTS = ("my landlord", "a new client", "my team", "a professor", "a hiring manager", "a neighbor",
              "customer support")
SUBJECTS = ("a late payment", "rescheduling a meeting", "a project update", "a broken heater", "a refund request",
            "a thank-you for their help", "a request for a reference", "a noise complaint", "vacation plans")
NAMES = ("Maya", "Leo", "Aisha", "Tom", "Sofia", "Ravi", "Emma", "Kenji", "Lucia", "Omar")
ITEMS = ("apples", "marbles", "books", "stickers", "cookies", "pencils", "coins", "cards")

FAMILIES = {
    "explain": (("Explain {concept} to a beginner.", "What is {concept}, and why does it matter?",
                 "How does {concept} work?", "Describe {concept} in simple terms.",
                 "Explain {concept} with an everyday analogy.", "What are common misconceptions about {concept}?"),
                {"concept": CONCEPTS}),
    "compare": (("What are the main differences between {a} and {b}?",
                 "Should I choose {a} or {b}? Explain the trade-offs.",
                 "Compare {a} and {b} in a short table.", "When is {a} better than {b}?"), {"pair": PAIRS}),
    "tips": (("Give me {n} tips for {goal}.", "What are the best ways to get better at {goal}?",
              "I want to get started with {goal}. Where do I begin?", "What mistakes do people make when {goal}?"),
             {"goal": GOALS, "n": ("three", "five", "seven")}),
    "howto": (("How do I {task}?", "Walk me through how to {task}, step by step.", "What do I need to {task}?",
               "What is the fastest way to {task}?"), {"task": TASKS}),
    "why": (("Why {phenomenon}?", "Can you explain why {phenomenon}?",
             "My kid asked me why {phenomenon}. What should I say?"),
            {"phenomenon": PHENOMENA}),
    "creative": (("Write a short poem about {thing}.", "Write a limerick about {thing}.",
                  "Write a haiku about {thing}.",
                  "Write a very short story about {thing}.", "Describe {thing} in vivid detail."), {"thing": THINGS}),
    "books": (("Summarize the plot of {work} in a few sentences.", "Who are the main characters in {work}?",
               "What are the main themes of {work}?", "Why is {work} still read today?"), {"work": WORKS}),
    "travel": (("Plan a {days}-day trip to {city}.", "What are the must-see sights in {city}?",
                "What food should I try in {city}?", "What is the best time of year to visit {city}?"),
               {"city": CITIES, "days": ("one", "two", "three")}),
    "cooking": (("Describe how to make {dish}.", "Give me a simple recipe for {dish}.",
                 "How can I make {dish} healthier?", "What goes well with {dish}?"), {"dish": DISHES}),
    "code": (("Write a Python function that {fn}.", "Write a {lang} function that {fn}, with a short explanation.",
              "How would you test a function that {fn}?"), {"fn": FUNCTIONS, "lang": LANGS}),
    "concept_code": (("Explain {concept} in {lang} with a small example.", "How is {concept} done in {lang}?"),
                     {"concept": ("recursion", "error handling", "closures", "iterators", "sorting", "hash maps",
                                  "string formatting", "reading files", "classes", "unit tests", "async code"),
                      "lang": LANGS}),
    "rewrite": (("Rewrite this sentence to be more formal: \"{s}\"", "Fix the grammar of this sentence: \"{s}\"",
                 "Translate into French: \"{s}\"", "Make this sentence friendlier: \"{s}\""), {"s": SENTENCES}),
    "email": (("Write a short email to {to} about {about}.", "Draft a polite message to {to} about {about}."),
              {"to": RECIPIENTS, "about": SUBJECTS}),
}
FOLLOWUPS = (
    "Can you make that shorter?", "Give me a concrete example.", "Now explain it to a ten-year-old.",
    "What are the most common mistakes here?", "Turn that into a bulleted list.", "Can you expand on the first point?",
    "Summarize your answer in one sentence.", "Rewrite that in a more formal tone.",
    "Are there any risks I should know about?",
    "What is one thing I could do today to get started?", "Thanks! Can you add a short conclusion?",
    "Can you give me three follow-up questions to think about?", "Now write the same thing as a short poem.")


# Asked after a base prompt: the same question in another length, form or register is another response.
STYLES = ("", " Keep it brief.", " Answer in one paragraph.", " Use bullet points.", " Explain it like I'm five.",
          " Include an example.", " Answer in three sentences.", " Be thorough.", " Start with a one-line summary.",
          " Write for a busy professional.", " Use simple words.", " End with a practical tip.", " Number the steps.",
          " Use a friendly tone.", " Answer as a teacher would.")


def family_prompts(name: str) -> list[str]:
    """Every distinct base prompt of one family: its phrasings x the product of its slot lists."""
    if name == "topics":
        return [t.format(t=topic) for t in TOPIC_TASKS for topic in TOPICS]
    phrasings, slots = FAMILIES[name]
    keys = list(slots)
    out = {}
    for values in itertools.product(*(slots[k] for k in keys)):
        fill = dict(zip(keys, values))
        if "pair" in fill:
            fill["a"], fill["b"] = fill.pop("pair")
        out |= dict.fromkeys(p.format(**fill) for p in phrasings)
    return list(out)


def math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 90), rng.randint(2, 60), rng.randint(1, 30)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice((
        f"{name} has {a} {item}, buys {b} more and gives away {c}. How many are left? Show your steps.",
        f"What is {c}% of {a * b}? Explain how you got it.",
        f"A train travels {a * 10} km in {c % 9 + 2} hours. What is its average speed?",
        f"A recipe for {b % 6 + 2} people needs {a} grams of flour. How much for {c % 9 + 3} people?",
        f"Solve for x: {b}x + {a} = {a + b * c}.",
        f"{name} saves {a} dollars a week. How long until they have {a * (c + 4)} dollars?"))


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to n distinct chat prompts (fewer when the families hold fewer). Each family's base prompts x
    STYLES are shuffled (unstyled first) and the families dealt round-robin, math problems drawn fresh (one
    share in len(FAMILIES) + 2), so every prefix mixes all families."""
    rng = random.Random(seed)
    pools = []
    for name in ("topics", *FAMILIES):
        bases = family_prompts(name)
        rng.shuffle(bases)
        styled = [b + s for s in STYLES[1:] for b in bases]
        rng.shuffle(styled)
        pools.append(bases + styled)
    math, seen, want = [], set(), max(1, n // (len(pools) + 1))
    while len(math) < want and len(seen) < 4 * want:
        m = math_prompt(rng)
        if m not in seen:
            math.append(m)
        seen.add(m)
    pools.append(math)
    dealt = (p for row in itertools.zip_longest(*pools) for p in row if p is not None)
    return list(dict.fromkeys(dealt))[:n]


def tool_request(name: str, topic: str, rng: random.Random) -> str:
    words = name.replace("_", " ").replace("-", " ")
    return rng.choice((f"Please {words} for me. It is about {topic}.", f"Can you {words}? Context: {topic}.",
                       f"I need to {words} - something related to {topic}.",
                       f"Use the right tool to {words} ({topic})."))


def tool_result(rng: random.Random) -> str:
    return rng.choice(('{"status": "ok", "result": "done", "id": %d}', '{"status": "ok", "items": %d}',
                       '{"status": "error", "message": "not found", "code": %d}')) % rng.randint(1, 9999)
