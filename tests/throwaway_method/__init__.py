"""A throwaway drafting method defined outside draftsmith (tests/test_methods.py): its files, one per stage, with
the hooks draftsmith.core.method_hooks types; the test adds it with one row (`methods.register`)."""
