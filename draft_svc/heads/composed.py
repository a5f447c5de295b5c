"""Training requests composed from this project's own lists (under the project's licence).

The drafter learns what the primary writes to users, so its prompts must ask what users ask. The
Python-derived sources of draft_svc/heads/data.py cover one language's functions and documentation;
measured on unseen prompts the drafter trained on them alone agreed with the primary's next token
about half as often as on its own validation split (docs/benchmarks.md, "Drafts"). These lists widen
the requests, not the answers (the answers are always the primary's own):

    programming    a task in one of many programming languages, asked several ways
    concepts       explain or compare a concept of computing, science or everyday knowledge
    everyday       emails, plans, advice and other practical writing
    multilingual   requests written in other languages (the model answers as it will)
    tool-calls     a spoken request and the JSON Schema of a tool's arguments (answered under it)

Every list here was written for this project; none is drawn from a benchmark set.
"""

from __future__ import annotations

import json
import random
from typing import Any

PROGRAMMING_LANGUAGES = (
    "Python", "JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "Kotlin", "Swift",
    "PHP", "Ruby", "Bash", "SQL", "R", "Dart", "Lua", "Scala", "Haskell",
)  # fmt: skip
PROGRAM_TASKS = (
    "reads a CSV file and prints the average of one column", "checks whether a string is a palindrome",
    "implements a binary search tree with insert, search and delete", "merges two sorted lists into one",
    "counts how often each word appears in a text file", "validates an email address",
    "implements an LRU cache with a fixed capacity", "parses command-line arguments and prints a help message",
    "computes the Levenshtein distance between two strings", "finds the shortest path in a grid with BFS",
    "implements quicksort", "reverses a singly linked list", "generates a random password of a given length",
    "implements a rate limiter that allows N calls per second", "retries a failing call with exponential backoff",
    "implements a min-heap with push and pop", "implements Dijkstra's algorithm on a weighted graph",
    "detects a cycle in a directed graph", "implements a trie for word autocompletion",
    "serializes a binary tree to a string and back", "converts a Roman numeral to an integer",
    "computes the moving average of a stream of numbers", "implements a simple bank account class",
    "simulates a traffic light as a state machine", "reads a JSON configuration file with defaults",
    "implements a thread-safe producer-consumer queue", "runs a parameterized query against a database",
    "implements a tiny HTTP server that returns the current time", "flattens a nested list",
    "finds all prime numbers below a limit with a sieve", "multiplies two matrices",
    "implements tic-tac-toe for two players in the terminal", "groups a list of records by a key",
    "removes duplicate lines from a file while keeping their order", "implements a stack with a max operation",
    "converts a date string from one format to another", "computes the factorial of a number recursively",
    "implements k-means clustering for 2D points", "renders a table of data as aligned text",
    "implements an event emitter with subscribe and unsubscribe", "debounces a function",
    "paginates a list of items", "checks whether two strings are anagrams", "computes Fibonacci numbers quickly",
    "implements a simple tokenizer for arithmetic expressions", "evaluates an arithmetic expression",
    "downloads a web page and lists its links", "compresses a string with run-length encoding",
    "finds the longest common prefix of a list of strings", "rotates an image matrix by 90 degrees",
    "implements a to-do list with add, remove and list commands", "writes unit tests for a sorting function",
)  # fmt: skip
PROGRAM_TEMPLATES = (
    "Write a {language} program that {task}.",
    "How do I write {language} code that {task}?",
    "Can you show me {language} code that {task}? Explain it briefly.",
    "I'm learning {language}. Write a function that {task} and explain each step.",
    "Write {language} code that {task}, with comments.",
    "Give me an efficient {language} solution: a function that {task}. What is its complexity?",
    "My {language} code that {task} is slow. How would you write it?",
)
CONCEPTS = (
    "recursion", "closures", "the event loop", "database indexes", "TCP and UDP", "big-O notation",
    "garbage collection", "REST APIs", "containers", "git branches", "dependency injection", "deadlocks",
    "public-key cryptography", "hash tables", "gradient descent", "overfitting", "virtual memory", "DNS",
    "OAuth", "unit tests", "async and await", "SQL joins", "caching", "load balancing", "microservices",
    "regular expressions", "floating-point rounding", "UTF-8", "pointers", "generics",
    "the observer pattern", "CORS", "websockets", "memory leaks", "dynamic programming",
    "neural networks", "Bayes' theorem", "eigenvectors", "the Fourier transform", "compound interest",
    "photosynthesis", "black holes", "inflation", "vaccines", "the water cycle", "plate tectonics",
    "supply and demand", "climate change", "the immune system", "electric motors",
)  # fmt: skip
CONCEPT_TEMPLATES = (
    "Explain {concept} with an example.",
    "What is {concept}? Explain it to a beginner.",
    "What are the most common mistakes people make with {concept}?",
    "Give me a short tutorial on {concept}.",
    "Why does {concept} matter? Answer in a few paragraphs.",
    "Compare {concept} and {other}: how are they related?",
)
EVERYDAY_TEMPLATES = (
    "Write an email to {person} about {topic}.",
    "Give me a step-by-step plan for {goal}.",
    "What are some practical tips for {goal}?",
    "Help me write a short message to {person} about {topic}.",
    "Make a checklist for {goal}.",
    "I have one week for {goal}. How should I organise it?",
)
PEOPLE = (
    "my manager", "a new colleague", "my landlord", "a customer", "my teacher", "a neighbour",
    "the school principal", "a hotel", "my team", "an old friend", "a supplier", "the city council",
)  # fmt: skip
TOPICS = (
    "a delayed delivery", "a meeting next Tuesday", "a broken heater", "a refund request", "a project update",
    "a team dinner", "a job application", "a noise problem", "a change of schedule", "a thank-you",
    "a price increase", "a missed deadline",
)  # fmt: skip
GOALS = (
    "learning to cook", "preparing for a job interview", "running a first 10 km race", "moving house",
    "saving for a holiday", "starting a small online shop", "studying for an exam", "sleeping better",
    "organising a birthday party", "learning to play the guitar", "planting a vegetable garden",
    "writing a novel", "reducing screen time", "planning a road trip", "keeping a budget",
)  # fmt: skip
# Requests in other languages, written for this project: (language, templates, subjects)
MULTILINGUAL: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("Spanish", ("Escribe una historia corta sobre {s}.", "Explícame {s} de forma sencilla.",
                 "Dame consejos prácticos sobre {s}."),
     ("un viaje en tren", "la amistad", "aprender a programar", "el cambio climático", "una ciudad de noche",
      "cocinar en casa", "un perro perdido", "el primer día de trabajo")),
    ("French", ("Écris un poème sur {s}.", "Explique-moi {s} simplement.", "Donne-moi des conseils sur {s}."),
     ("la mer en hiver", "l'amitié", "apprendre une langue", "la cuisine française", "un voyage à Paris",
      "le sommeil", "les réseaux sociaux", "un vieux jardin")),
    ("German", ("Schreib eine kurze Geschichte über {s}.", "Erkläre mir {s} einfach.",
                "Gib mir Tipps zu {s}."),
     ("einen Winterabend", "die Arbeit im Homeoffice", "das Sparen", "einen Roboter", "den Wald",
      "gesunde Ernährung", "eine Zugreise", "das Lernen für Prüfungen")),
    ("Portuguese", ("Escreva uma história sobre {s}.", "Explique {s} de forma simples.",
                    "Quais são as melhores dicas para {s}?"),
     ("o mar", "uma família", "aprender inglês", "economizar dinheiro", "uma cidade pequena", "o futebol",
      "plantar uma horta", "uma viagem")),
    ("Italian", ("Scrivi un racconto breve su {s}.", "Spiegami {s} in modo semplice.",
                 "Dammi dei consigli su {s}."),
     ("un'estate al mare", "la cucina italiana", "un gatto curioso", "lo studio", "una città antica",
      "il lavoro di squadra", "la musica", "un viaggio in montagna")),
    ("Czech", ("Napiš krátký příběh o {s}.", "Vysvětli mi jednoduše {s}.", "Dej mi rady, jak {s}."),
     ("zimě na horách", "přátelství", "učit se programovat", "ušetřit peníze", "starém městě",
      "zdravě jíst", "cestě vlakem", "lepší spánek")),
    ("Vietnamese", ("Viết một câu chuyện ngắn về {s}.", "Giải thích {s} một cách đơn giản.",
                    "Cho tôi lời khuyên về {s}."),
     ("mùa mưa", "tình bạn", "học lập trình", "tiết kiệm tiền", "một thành phố về đêm", "nấu ăn",
      "một chuyến đi biển", "giấc ngủ")),
    ("Russian", ("Напиши короткий рассказ о {s}.", "Объясни простыми словами {s}.", "Дай советы про {s}."),
     ("зимнем лесе", "дружбе", "изучении языков", "экономии денег", "старом городе", "здоровом сне",
      "путешествии на поезде", "работе в команде")),
    ("Polish", ("Napisz krótkie opowiadanie o {s}.", "Wyjaśnij mi prosto {s}.", "Daj mi rady na temat {s}."),
     ("zimowym wieczorze", "przyjaźni", "nauce programowania", "oszczędzaniu", "starym mieście",
      "zdrowym jedzeniu", "podróży pociągiem", "pracy zdalnej")),
    ("Chinese", ("写一个关于{s}的小故事。", "请简单解释{s}。", "给我一些关于{s}的建议。"),
     ("春天", "友谊", "学习编程", "存钱", "一座古老的城市", "健康饮食", "一次旅行", "睡眠")),
    ("Japanese", ("{s}についての短い物語を書いてください。", "{s}を簡単に説明してください。",
                  "{s}についてのアドバイスをください。"),
     ("雨の日", "友情", "プログラミングの勉強", "節約", "古い町", "料理", "電車の旅", "睡眠")),
    ("Turkish", ("{s} hakkında kısa bir hikaye yaz.", "{s} konusunu basitçe açıkla.",
                 "{s} hakkında tavsiyeler ver."),
     ("deniz", "arkadaşlık", "programlama öğrenmek", "para biriktirmek", "eski bir şehir", "sağlıklı beslenme",
      "bir tren yolculuğu", "uyku")),
)  # fmt: skip
CITIES = (
    "Paris", "Tokyo", "Denver, CO", "Nairobi", "Lisbon", "Toronto", "Mumbai", "Sydney", "Berlin", "Austin, TX",
    "Mexico City", "Seoul", "Oslo", "Cape Town", "Buenos Aires", "Chicago, IL",
)  # fmt: skip
NAMES = ("Alice", "Bob", "Maria", "Kenji", "Fatima", "Lucas", "Priya", "Tom", "Elena", "Omar")
ITEMS = ("running shoes", "a coffee grinder", "noise-cancelling headphones", "a desk lamp", "a phone case",
         "a tent", "a blender", "a backpack")  # fmt: skip
DATES = ("tomorrow", "next Monday", "on June 3rd", "this Friday at 6 pm", "on the 15th", "in two weeks")


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# (tool's argument schema, request templates over the slots city / name / item / date / n)
TOOLS: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = (
    (_obj({"location": STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"]),
     ("What's the weather like in {city} right now, in celsius?", "Is it going to be hot in {city}? Use fahrenheit.")),
    (_obj({"origin": STR, "destination": STR, "date": STR, "passengers": INT}, ["origin", "destination", "date"]),
     ("Find me a flight from {city} to {city2} {date} for {n} people.", "Book flights {city} to {city2}, {date}.")),
    (_obj({"title": STR, "time": STR, "remind_before_minutes": INT}, ["title", "time"]),
     ("Remind me to call {name} {date}, 30 minutes before.", "Set a reminder for the dentist {date}.")),
    (_obj({"to": STR, "subject": STR, "body": STR}, ["to", "subject", "body"]),
     ("Send an email to {name} saying I'll be late {date}.", "Email {name} the agenda for our meeting {date}.")),
    (_obj({"query": STR, "max_results": INT, "sort_by": {"type": "string", "enum": ["price", "rating"]}},
          ["query"]),
     ("Search the shop for {item} and sort by rating, {n} results.", "I need cheap {item}: show the top {n}.")),
    (_obj({"amount": NUM, "from_currency": STR, "to_currency": STR}, ["amount", "from_currency", "to_currency"]),
     ("How much is {n}00 US dollars in euros?", "Convert {n}50 yen to British pounds.")),
    (_obj({"restaurant_city": STR, "party_size": INT, "time": STR, "cuisine": STR}, ["restaurant_city", "party_size"]),
     ("Book a table for {n} in {city} {date}, something Italian.", "Find a sushi place in {city} for {n} people.")),
    (_obj({"text": STR, "target_language": STR}, ["text", "target_language"]),
     ("Translate 'where is the train station' into Japanese.", "How do you say 'good morning, {name}' in Spanish?")),
    (_obj({"symbol": STR, "period_days": INT}, ["symbol"]),
     ("What did Apple's stock do over the last {n} days?", "Show me the price history of TSLA for {n} days.")),
    (_obj({"contact_name": STR, "phone": STR, "email": STR}, ["contact_name"]),
     ("Add {name} to my contacts, phone 555-01{n}{n}.", "Save a contact for {name} with email {name}@example.com.")),
    (_obj({"device": STR, "action": {"type": "string", "enum": ["on", "off"]}, "level": INT}, ["device", "action"]),
     ("Turn the living room lights on at {n}0 percent.", "Switch off the heater in the bedroom.")),
    (_obj({"event_name": STR, "start": STR, "duration_minutes": INT, "attendees": {"type": "array", "items": STR}},
          ["event_name", "start"]),
     ("Schedule a {n}0-minute call with {name} {date}.", "Put a team lunch with {name} in my calendar {date}.")),
    (_obj({"origin": STR, "destination": STR, "mode": {"type": "string", "enum": ["driving", "walking", "transit"]}},
          ["origin", "destination"]),
     ("How long does it take to drive from {city} to {city2}?", "Give me walking directions to the museum in {city}.")),
    (_obj({"recipe": STR, "servings": INT, "vegetarian": BOOL}, ["recipe"]),
     ("Find a vegetarian lasagna recipe for {n} people.", "I want to bake bread for {n}: find me a recipe.")),
    (_obj({"song": STR, "artist": STR, "shuffle": BOOL}, ["song"]),
     ("Play something by the Beatles, shuffled.", "Play the song {name} likes, Yesterday.")),
    (_obj({"order_id": STR, "reason": STR}, ["order_id"]),
     ("I want to return order {n}{n}{n}4, the {item} is broken.", "Cancel my order {n}7{n}2 please.")),
)  # fmt: skip


def programming_requests(rng: random.Random) -> list[str]:
    return [
        rng.choice(PROGRAM_TEMPLATES).format(language=language, task=task)
        for task in PROGRAM_TASKS
        for language in PROGRAMMING_LANGUAGES
    ]


def concept_requests(rng: random.Random) -> list[str]:
    out = []
    for concept in CONCEPTS:
        for template in CONCEPT_TEMPLATES:
            other = rng.choice([c for c in CONCEPTS if c != concept])
            out.append(template.format(concept=concept, other=other))
    return out


def everyday_requests(rng: random.Random) -> list[str]:
    """Each template over its own slots: every goal, or every (person, topic) pair."""
    out: list[str] = []
    for template in EVERYDAY_TEMPLATES:
        if "{goal}" in template:
            out.extend(template.format(goal=goal) for goal in GOALS)
        else:
            out.extend(template.format(person=p, topic=t) for p in PEOPLE for t in TOPICS)
    return out


def multilingual_requests() -> list[str]:
    return [t.format(s=s) for _, templates, subjects in MULTILINGUAL for t in templates for s in subjects]


def tool_requests(rng: random.Random) -> list[tuple[str, str]]:
    """(request, its tool's argument schema as JSON text): every template with up to 12 distinct slot
    fillings (a template without slots once)."""
    out: dict[str, str] = {}
    for schema, templates in TOOLS:
        text = json.dumps(schema)
        for template in templates:
            for _ in range(12):
                city, city2 = rng.sample(CITIES, 2)
                slots = {"city": city, "city2": city2, "name": rng.choice(NAMES), "item": rng.choice(ITEMS)}
                out.setdefault(template.format(**slots, date=rng.choice(DATES), n=rng.randint(2, 8)), text)
    return list(out.items())
