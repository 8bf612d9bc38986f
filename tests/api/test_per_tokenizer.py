"""api/prompt.PerTokenizer: values made once per tokenizer object, never found again by
an object that reuses a collected one's id."""
import gc

from mashbox.api.prompt import PerTokenizer


class _Tok:
    pass


def test_a_value_is_made_once_per_object_and_dropped_with_it():
    cache = PerTokenizer()
    made = []

    def make(tok):
        made.append(id(tok))  # not the object: the cache alone may hold it
        return len(made)

    a = _Tok()
    assert cache.get(a, make) == 1
    assert cache.get(a, make) == 1 and len(made) == 1
    a_id = id(a)
    del a
    gc.collect()
    assert len(cache) == 0  # the entry went with its tokenizer
    # objects made now may take the collected one's id; each must get its own value
    for _ in range(50):
        b = _Tok()
        value = cache.get(b, make)
        assert made[value - 1] == id(b) and value == len(made)
        if id(b) == a_id:
            break
        del b
        gc.collect()
