"""One launch per key, shared by every test that reads from it."""
import functools


def launch_once(start):
    """Decorate ``start(*key)`` so each key runs once per test session.

    A failure is remembered and re-raised by every test that asks for the same key
    (one broken layout fails its tests at once instead of relaunching for each).
    """
    outcomes = {}

    @functools.wraps(start)
    def run(*key):
        if key not in outcomes:
            try:
                outcomes[key] = (start(*key), None)
            except Exception as err:  # noqa: BLE001 - re-raised below, for every caller
                outcomes[key] = (None, err)
        result, error = outcomes[key]
        if error is not None:
            raise error
        return result

    return run
