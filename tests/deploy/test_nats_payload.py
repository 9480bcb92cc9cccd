"""Every NATS flotilla deploys takes the payloads a prompt's images need (docs/vision.md):
the stack's own nats-server, docker-compose's and the Helm chart's, all at NATS_MAX_PAYLOAD
and NATS_MAX_PENDING."""

from __future__ import annotations

import re
from pathlib import Path

from cli.processes import nats_config_file
from shared.sections.media import NATS_MAX_PAYLOAD, NATS_MAX_PENDING
from tests.deploy.tools import compose_config, helm_template_text


def test_every_deployed_nats_takes_image_payloads():
    wanted = f"max_payload: {NATS_MAX_PAYLOAD}\nmax_pending: {NATS_MAX_PENDING}"
    assert Path(nats_config_file()).read_text().strip() == wanted
    compose = compose_config()
    mounted = {c["source"]: c["target"] for c in compose["services"]["nats"]["configs"]}
    command = compose["services"]["nats"]["command"]
    assert command[command.index("-c") + 1] == mounted["nats-config"]
    assert compose["configs"]["nats-config"]["content"].strip() == wanted
    helm = helm_template_text()
    assert re.search(rf'"max_payload": {NATS_MAX_PAYLOAD},', helm)
    assert re.search(rf'"max_pending": {NATS_MAX_PENDING},', helm)
