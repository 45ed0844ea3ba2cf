"""What `vlmpack export-hf` writes from: shard manifests record the chat template's text in
the profile, without changing the profile's fingerprint id; the built-in profiles' templates
are the official ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from preprocess.profiles import OFFICIAL_TEMPLATE_SHA256, builtin_profile
from shards_schema.builtin import BUILTIN_CHAT_TEMPLATES, CHAT_TEMPLATE_DIR, builtin_chat_template
from tests.conftest import FIXTURES_DIR


def manifest_profile(profile) -> dict:
    """The profile as a shard manifest records it (JSON, as preprocessing writes it)."""
    return json.loads(json.dumps(profile.fingerprint))


def test_bundled_templates_are_the_official_ones_and_their_text_leaves_the_fingerprint_id_alone():
    for name, file in BUILTIN_CHAT_TEMPLATES.items():
        assert (CHAT_TEMPLATE_DIR / file).read_bytes() == (FIXTURES_DIR / file).read_bytes()
        profile = builtin_profile(name)
        recorded = manifest_profile(profile)
        assert recorded["chat_template"] == builtin_chat_template(name)
        assert hashlib.sha256(recorded["chat_template"].encode()).hexdigest() == recorded["chat_template_sha256"] \
            == OFFICIAL_TEMPLATE_SHA256[name]
    # the id hashes the template's sha256, not its text: the ids of data made before the text
    # was recorded stay what they were
    assert dataclasses.replace(profile, chat_template="other").fingerprint["id"] == recorded["id"]
