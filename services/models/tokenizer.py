"""A small byte-level BPE tokenizer for the synthetic checkpoints tests write.

It is trained offline, in a few milliseconds, on the short English text below, so a test
checkpoint needs no download. Being byte-level it encodes any UTF-8 text and decodes it
back unchanged; the same text and settings always give the same vocabulary.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# Special tokens come first, so their ids are fixed: <s> = 0, </s> = 1.
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
VOCAB_SIZE = 640

_TRAINING_TEXT = """\
The river runs past the old mill and under the stone bridge before it reaches the sea.
In the morning the baker opens the shop, and the smell of fresh bread fills the street.
Children walk to school in small groups, talking about games, homework and the weather.
A good map shows where the roads go, but it cannot tell you how long the journey feels.
When the wind turns to the north, the fishermen pull their boats high onto the beach.
She wrote the numbers in a notebook: one, two, three, four, five, six, seven, eight.
The library is quiet in the afternoon, and the only sound is the turning of pages.
He asked whether the train would be late again, and the answer was, as usual, maybe.
Every question has an answer, although some answers take a very long time to find.
The garden needs water after a dry week; the tomatoes are red and the beans are tall.
Computers follow instructions exactly, which is why a small mistake can cause trouble.
A server receives a request, does the work, and sends a response back to the client.
The model reads the prompt, predicts the next token, and repeats until it is finished.
If the queue is full, new requests must wait, or the system has to say no politely.
Memory is limited, so the engine keeps a cache of keys and values for each sequence.
Time is measured in milliseconds here: the first token, then every token after it.
On Sunday the market sells apples, cheese, honey, flowers and warm cups of coffee.
The teacher said that reading every day is the best way to learn a new language.
Mountains look close on a clear day, yet the path to the top is longer than it seems.
Please write clearly, check your work twice, and ask for help when you need it.
What is the capital of France? Paris. What is two plus two? Four. Why is the sky blue?
Light from the sun is scattered by the air, and blue light is scattered the most.
Once upon a time there was a small town where nothing surprising ever happened.
Then one evening a stranger arrived with a suitcase full of maps and old letters.
The people of the town gathered to listen, because stories were rare and precious.
"Where do you come from?" they asked. "From everywhere," he said, "and from nowhere."
Numbers such as 10, 42, 100, 2024 and 3.14 appear in text more often than you think.
Punctuation matters too; commas, periods, colons and quotes all carry some meaning.
"""


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer (``VOCAB_SIZE`` entries, ``<s>`` prepended)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    # Like Hugging Face Llama tokenizers: encoding with special tokens prepends <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    if (
        tokenizer.token_to_id(BOS_TOKEN) != BOS_TOKEN_ID
        or tokenizer.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID
    ):
        raise RuntimeError("special token ids moved; the tokenizers library changed its layout")
    return tokenizer
