"""The sentence grammar of the synthetic corpus: a small hand-written grammar whose templates x
word choices give ~1e12 distinct, grammatical English sentences. The word lists deliberately cover
every English phoneme eSpeak uses (e.g. "measure"/"garage" for ʒ, "boy"/"voice" for ɔɪ,
"button"/"kitten" for ʔ n̩, "book" for ʊ)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

_NAMES = (
    "Anna", "Ben", "Carlos", "Diana", "Edward", "Fiona", "George", "Hannah", "Isaac", "Julia",
    "Kevin", "Laura", "Martin", "Nora", "Oliver", "Paula", "Quentin", "Rachel", "Samuel", "Teresa",
    "Victor", "Wendy", "Zachary", "Joseph", "Charlotte", "Thomas", "Sophia", "William", "Judith",
    "Arthur", "Helen", "Frederick", "Margaret", "Timothy", "Vivian", "Roger", "Sheila", "Walter",
    "Yvonne", "Matthew", "Joyce", "Hugh", "Ruth", "Jerome", "Beatrice",
)  # fmt: skip
# (singular, plural)
_NOUNS = (
    ("dog", "dogs"), ("cat", "cats"), ("horse", "horses"), ("bird", "birds"), ("fish", "fish"),
    ("child", "children"), ("woman", "women"), ("man", "men"), ("person", "people"),
    ("teacher", "teachers"), ("doctor", "doctors"), ("farmer", "farmers"), ("soldier", "soldiers"),
    ("lawyer", "lawyers"), ("player", "players"), ("driver", "drivers"), ("singer", "singers"),
    ("judge", "judges"), ("king", "kings"), ("queen", "queens"), ("boy", "boys"), ("girl", "girls"),
    ("neighbor", "neighbors"), ("stranger", "strangers"), ("engineer", "engineers"),
    ("book", "books"), ("letter", "letters"), ("table", "tables"), ("chair", "chairs"),
    ("window", "windows"), ("door", "doors"), ("bottle", "bottles"), ("button", "buttons"),
    ("kitten", "kittens"), ("garden", "gardens"), ("mountain", "mountains"), ("river", "rivers"),
    ("bridge", "bridges"), ("village", "villages"), ("church", "churches"), ("castle", "castles"),
    ("garage", "garages"), ("treasure", "treasures"), ("measure", "measures"),
    ("television", "televisions"), ("voice", "voices"), ("toy", "toys"), ("coin", "coins"),
    ("picture", "pictures"), ("question", "questions"), ("answer", "answers"), ("story", "stories"),
    ("song", "songs"), ("ring", "rings"), ("box", "boxes"), ("watch", "watches"),
    ("knife", "knives"), ("leaf", "leaves"), ("wolf", "wolves"), ("mouse", "mice"),
    ("foot", "feet"), ("tooth", "teeth"), ("sheep", "sheep"), ("jacket", "jackets"),
    ("orange", "oranges"), ("cheese", "cheeses"), ("sandwich", "sandwiches"), ("cake", "cakes"),
    ("apple", "apples"), ("potato", "potatoes"), ("tomato", "tomatoes"), ("engine", "engines"),
    ("computer", "computers"), ("telephone", "telephones"), ("machine", "machines"),
    ("key", "keys"), ("map", "maps"), ("boat", "boats"), ("train", "trains"), ("car", "cars"),
    ("truck", "trucks"), ("plane", "planes"), ("bicycle", "bicycles"), ("hat", "hats"),
    ("shoe", "shoes"), ("glove", "gloves"), ("feather", "feathers"), ("stone", "stones"),
    ("flower", "flowers"), ("tree", "trees"), ("forest", "forests"), ("island", "islands"),
    ("ocean", "oceans"), ("cloud", "clouds"), ("star", "stars"), ("moon", "moons"),
    ("hour", "hours"), ("year", "years"), ("idea", "ideas"), ("theory", "theories"),
    ("museum", "museums"), ("problem", "problems"), ("message", "messages"), ("package", "packages"),
    ("curtain", "curtains"), ("pillow", "pillows"), ("blanket", "blankets"), ("wheel", "wheels"),
    ("hammer", "hammers"), ("ladder", "ladders"), ("basket", "baskets"), ("candle", "candles"),
    ("mirror", "mirrors"), ("photograph", "photographs"), ("umbrella", "umbrellas"),
    ("newspaper", "newspapers"), ("pencil", "pencils"), ("envelope", "envelopes"),
)  # fmt: skip
_ADJECTIVES = (
    "big", "small", "old", "young", "new", "red", "blue", "green", "yellow", "purple", "orange",
    "brown", "white", "black", "heavy", "light", "quiet", "loud", "happy", "sad", "angry",
    "tired", "hungry", "curious", "careful", "clever", "strange", "famous", "beautiful", "ugly",
    "wooden", "golden", "silver", "broken", "empty", "dirty", "clean", "warm", "cold", "wet",
    "dry", "soft", "hard", "smooth", "rough", "sharp", "bright", "dark", "enormous", "tiny",
    "ancient", "modern", "usual", "unusual", "pleasant", "nervous", "royal", "noisy", "thirsty",
    "lazy", "busy", "friendly", "gentle", "proud", "honest", "foolish", "expensive", "cheap",
    "delicious", "bitter", "sweet", "fresh", "rotten", "shiny", "narrow", "wide", "thick", "thin",
)  # fmt: skip
# (base, past) transitive verbs
_VERBS_T = (
    ("see", "saw"), ("find", "found"), ("take", "took"), ("bring", "brought"), ("buy", "bought"),
    ("sell", "sold"), ("give", "gave"), ("hold", "held"), ("carry", "carried"), ("push", "pushed"),
    ("pull", "pulled"), ("open", "opened"), ("close", "closed"), ("break", "broke"),
    ("fix", "fixed"), ("paint", "painted"), ("wash", "washed"), ("cook", "cooked"),
    ("eat", "ate"), ("drink", "drank"), ("throw", "threw"), ("catch", "caught"),
    ("watch", "watched"), ("follow", "followed"), ("chase", "chased"), ("visit", "visited"),
    ("measure", "measured"), ("enjoy", "enjoyed"), ("avoid", "avoided"), ("choose", "chose"),
    ("borrow", "borrowed"), ("lend", "lent"), ("hide", "hid"), ("steal", "stole"),
    ("forget", "forgot"), ("remember", "remembered"), ("describe", "described"),
    ("deliver", "delivered"), ("hear", "heard"), ("notice", "noticed"), ("touch", "touched"),
    ("climb", "climbed"), ("draw", "drew"), ("pack", "packed"), ("lift", "lifted"),
    ("drop", "dropped"), ("keep", "kept"), ("leave", "left"), ("love", "loved"), ("hate", "hated"),
    ("admire", "admired"), ("ignore", "ignored"), ("judge", "judged"), ("explore", "explored"),
    ("examine", "examined"), ("study", "studied"), ("photograph", "photographed"),
)  # fmt: skip
# (base, past) intransitive verbs
_VERBS_I = (
    ("sleep", "slept"), ("run", "ran"), ("walk", "walked"), ("sing", "sang"), ("dance", "danced"),
    ("laugh", "laughed"), ("cry", "cried"), ("shout", "shouted"), ("whisper", "whispered"),
    ("wait", "waited"), ("arrive", "arrived"), ("leave", "left"), ("swim", "swam"),
    ("fly", "flew"), ("travel", "traveled"), ("work", "worked"), ("rest", "rested"),
    ("smile", "smiled"), ("listen", "listened"), ("disappear", "disappeared"), ("return", "returned"),
    ("hurry", "hurried"), ("worry", "worried"), ("complain", "complained"), ("agree", "agreed"),
    ("argue", "argued"), ("fall", "fell"), ("sit", "sat"), ("stand", "stood"), ("wander", "wandered"),
)  # fmt: skip
_ADVERBS = (
    "quickly", "slowly", "quietly", "loudly", "carefully", "happily", "sadly", "suddenly",
    "gently", "eagerly", "usually", "rarely", "often", "again", "together", "alone", "early",
    "late", "yesterday", "today", "badly", "easily", "proudly", "nervously", "honestly",
)  # fmt: skip
_PREPOSITIONS = (
    "in", "on", "under", "behind", "near", "beside", "above", "below", "inside", "outside",
    "across", "through", "toward", "around", "beyond", "without", "with", "along",
)  # fmt: skip
_DETERMINERS = ("the", "a", "this", "that", "every", "my", "your", "our", "their", "his", "her")
_PLURAL_DETERMINERS = ("the", "some", "these", "those", "many", "few", "all the", "our", "their")
_TIMES = (
    "on monday", "on tuesday", "on wednesday", "on thursday", "on friday", "on saturday",
    "on sunday", "last night", "last week", "this morning", "in the evening", "at noon",
    "before breakfast", "after dinner", "in january", "in june", "in september", "every day",
    "at midnight", "in the afternoon",
)  # fmt: skip
_NUMBERS = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
    "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "a hundred", "a thousand",
)  # fmt: skip
_MODALS = ("will", "can", "should", "might", "must", "could", "would")
_DEGREE = ("very", "quite", "rather", "really", "extremely", "somewhat", "too")
_CONJUNCTIONS = ("and", "but", "because", "while", "so", "although", "when", "after", "before", "until")
_COPULA_VERBS = ("was", "seemed", "looked", "became", "felt")
_SAY_VERBS = ("said", "thought", "believed", "explained", "noticed", "decided")
_FUNCTION_WORDS = ("did", "not", "why", "where", "how", "is", "were", "never", "already", "there")


class SentenceGenerator:
    """Deterministic stream of distinct English sentences, such as ``"The tired farmer carried a
    golden basket across the bridge, because Anna never whispered."``; each appears at most once
    per generator.

    Args:
        seed: RNG seed; the same seed always yields the same sentence sequence.
        max_clauses: sentences join 1..max_clauses clauses with conjunctions.
        clause_weights: relative probability of 1, 2, ... clauses (default favours 1-2,
            giving ~11 words and ~4 s of speech per sentence on average at 175 words/min).
    """

    GRAMMAR_VERSION = 1  # bump when word lists/templates change: part of the corpus cache key

    def __init__(self, seed: int = 0, max_clauses: int = 3, clause_weights: Sequence[float] = (0.45, 0.4, 0.15)):
        self.rng = random.Random(f"sentences:{seed}")
        self.max_clauses = max_clauses
        self.clause_weights = list(clause_weights)[:max_clauses]
        self.seen: set[str] = set()
        self._returned: list[str] = []  # sentences handed back with give_back(), served first

    # --- phrase builders ------------------------------------------------------------------------
    def _noun_phrase(self, plural: bool = False) -> str:
        r = self.rng
        singular, plural_form = r.choice(_NOUNS)
        adj = f"{r.choice(_ADJECTIVES)} " if r.random() < 0.6 else ""
        if plural:
            return f"{r.choice(_PLURAL_DETERMINERS)} {adj}{plural_form}"
        det = r.choice(_DETERMINERS)
        if det == "a" and (adj or singular)[0] in "aeiou":
            det = "an"  # eSpeak reads "an" and "a" differently; keep the text grammatical
        return f"{det} {adj}{singular}"

    def _subject(self) -> tuple[str, bool]:
        r = self.rng
        x = r.random()
        if x < 0.3:
            return r.choice(_NAMES), False
        if x < 0.8:
            return self._noun_phrase(), False
        return self._noun_phrase(plural=True), True

    def _object(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.15:
            return r.choice(_NAMES)
        if x < 0.3:
            return f"{r.choice(_NUMBERS)} {r.choice(_ADJECTIVES) + ' ' if r.random() < 0.4 else ''}{r.choice(_NOUNS)[1]}"
        return self._noun_phrase(plural=r.random() < 0.2)

    def _tail(self) -> str:
        r = self.rng
        parts = []
        if r.random() < 0.45:
            parts.append(f"{r.choice(_PREPOSITIONS)} {self._noun_phrase(plural=r.random() < 0.2)}")
        if r.random() < 0.25:
            parts.append(r.choice(_ADVERBS))
        if r.random() < 0.2:
            parts.append(r.choice(_TIMES))
        return (" " + " ".join(parts)) if parts else ""

    def _clause(self) -> str:
        r = self.rng
        subject, plural = self._subject()
        kind = r.random()
        if kind < 0.4:  # subject + transitive verb + object
            return f"{subject} {r.choice(_VERBS_T)[1]} {self._object()}{self._tail()}"
        if kind < 0.6:  # subject + intransitive verb
            return f"{subject} {r.choice(_VERBS_I)[1]}{self._tail()}"
        if kind < 0.72:  # modal
            neg = " not" if r.random() < 0.2 else ""
            return f"{subject} {r.choice(_MODALS)}{neg} {r.choice(_VERBS_T)[0]} {self._object()}{self._tail()}"
        if kind < 0.84:  # copula + adjective
            verb = r.choice(_COPULA_VERBS)
            if verb == "was" and plural:
                verb = "were"
            degree = f"{r.choice(_DEGREE)} " if r.random() < 0.5 else ""
            return f"{subject} {verb} {degree}{r.choice(_ADJECTIVES)}{self._tail()}"
        if kind < 0.92:  # reported speech
            return f"{r.choice(_NAMES)} {r.choice(_SAY_VERBS)} that {subject} {r.choice(_VERBS_T)[1]} {self._object()}"
        return f"{subject} {r.choice(('never', 'already'))} {r.choice(_VERBS_T)[1]} {self._object()}{self._tail()}"

    def _question(self) -> str:
        r = self.rng
        subject, _ = self._subject()
        kind = r.random()
        if kind < 0.5:
            return f"did {subject} {r.choice(_VERBS_T)[0]} {self._object()}{self._tail()}"
        if kind < 0.75:
            return f"{r.choice(('why', 'where', 'how'))} did {subject} {r.choice(_VERBS_I)[0]}{self._tail()}"
        return f"why is {self._noun_phrase()} so {r.choice(_ADJECTIVES)}"

    def sentence(self) -> str:
        """One sentence (may repeat; :meth:`__iter__` removes repeats)."""
        r = self.rng
        if r.random() < 0.12:
            text, end = self._question(), "?"
        else:
            n = r.choices(range(1, len(self.clause_weights) + 1), weights=self.clause_weights)[0]
            text = self._clause()
            for _ in range(n - 1):
                text += f", {r.choice(_CONJUNCTIONS)} {self._clause()}"
            end = "."
        return text[0].upper() + text[1:] + end

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        """The next sentence never returned before (the stream is infinite)."""
        if self._returned:
            return self._returned.pop(0)
        while True:
            s = self.sentence()
            if s not in self.seen:
                self.seen.add(s)
                return s

    def give_back(self, sentences: Sequence[str]) -> None:
        """Return drawn but unused sentences; they are served again, in order, before new ones."""
        self._returned[:0] = list(sentences)
