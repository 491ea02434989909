"""A conversation's derived prompt-cache key (app/serving/cache_key.py): the same on every turn of one conversation,
different across conversations, API keys and gateways' secrets, and revealing nothing of the text or the key."""

from app.serving.cache_key import PREFIX, ConversationKeys
from clients.base import GenerationRequest

SECRET = b"a gateway's secret of enough bytes"
SYSTEM = {"role": "system", "content": "You are a terse assistant for the Zanzibar project."}
FIRST = {"role": "user", "content": "How many moons does Jupiter have?"}
TURN_1 = [SYSTEM, FIRST]
TURN_2 = [
    SYSTEM,
    FIRST,
    {"role": "assistant", "content": "Ninety-five known moons."},
    {"role": "user", "content": "And Saturn?"},
]


def test_every_turn_of_a_conversation_has_the_same_key():
    keys = ConversationKeys(SECRET)
    first = keys.key("team-a", TURN_1)
    assert first is not None and first.startswith(PREFIX)
    assert keys.key("team-a", TURN_2) == first
    assert keys.key("team-a", [*TURN_2, {"role": "assistant", "content": "146."}]) == first


def test_the_key_depends_on_the_system_prompt_the_first_user_message_and_the_api_key():
    keys = ConversationKeys(SECRET)
    base = keys.key("team-a", TURN_1)
    other_system = [{"role": "system", "content": "You are verbose."}, FIRST]
    other_question = [SYSTEM, {"role": "user", "content": "How many moons does Mars have?"}]
    no_system = [FIRST]
    derived = {
        keys.key("team-b", TURN_1),
        keys.key("team-a", other_system),
        keys.key("team-a", other_question),
        keys.key("team-a", no_system),
    }
    assert base not in derived and len(derived) == 4


def test_parts_content_keys_the_same_way_each_time():
    keys = ConversationKeys(SECRET)
    parts = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert keys.key("k", parts) == keys.key("k", [*parts, {"role": "assistant", "content": "Hi"}])
    assert keys.key("k", parts) != keys.key("k", [SYSTEM, {"role": "user", "content": "Hello"}])


def test_another_secret_gives_another_key_and_a_drawn_secret_is_random():
    assert ConversationKeys(SECRET).key("k", TURN_1) != ConversationKeys(b"another secret").key("k", TURN_1)
    assert ConversationKeys().key("k", TURN_1) != ConversationKeys().key("k", TURN_1)


def test_the_key_contains_neither_the_text_nor_the_api_key():
    key = ConversationKeys(SECRET).key("sha256-0123456789abcdef", TURN_1)
    assert key is not None
    digest = key.removeprefix(PREFIX)
    assert len(digest) == 32 and set(digest) <= set("0123456789abcdef")
    for secret_or_text in ("0123456789abcdef", "Jupiter", "Zanzibar", "terse"):
        assert secret_or_text not in key


def test_no_messages_no_key():
    assert ConversationKeys(SECRET).key("k", []) is None


def test_the_clients_own_key_wins_over_the_derived_one():
    derived = GenerationRequest(prompt_text="p", cache_key="tandem-derived")
    assert derived.forwardable == {"prompt_cache_key": "tandem-derived"}
    own = GenerationRequest(prompt_text="p", extras={"prompt_cache_key": "mine"}, cache_key="tandem-derived")
    assert own.forwardable == {"prompt_cache_key": "mine"}
    assert GenerationRequest(prompt_text="p", extras={"top_k": 3}).forwardable == {"top_k": 3}
