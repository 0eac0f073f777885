"""The agent's discovery and scraping options, parsed from ``config.Settings``.

Settings holds them as the user gave them (``WATTWATCH_SCRAPE``, ``kubelet_url`` in the TOML file,
``--no-discover``...), checked like every setting; ``AgentOptions.from_settings`` parses the scrape
targets and works out the kubelet's token and certificate check, which is what the agent's code uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from wattwatch.agent.kubelet import SERVICE_ACCOUNT_TOKEN
from wattwatch.agent.poison import DEFAULT_POISON_AFTER
from wattwatch.agent.scrape import ScrapeTarget, parse_target, parse_targets
from wattwatch.config import Settings
from wattwatch.errors import ConfigError


@dataclass(frozen=True)
class AgentOptions:
    """What the agent discovers and scrapes, beyond ``config.Settings``."""

    discover: bool = True
    proc_root: Path = Path("/proc")
    kubelet_url: str = ""
    kubelet_token_file: Path | None = None
    kubelet_verify: bool | str = True
    scrape: tuple[ScrapeTarget, ...] = ()
    # The fine tick and the set-aside threshold: what they mean is in config.Settings.
    fine_interval_s: float = Settings.fine_interval_s
    fine_tick_hold_s: float = Settings.fine_tick_hold_s
    poison_after: int = DEFAULT_POISON_AFTER

    @classmethod
    def from_settings(cls, settings: Settings, scrape: Sequence[str] = ()) -> AgentOptions:
        """Parse ``settings``' agent fields; ``scrape`` (``--scrape`` specs) adds to its ``scrape`` targets.
        Raises ConfigError naming the bad value."""
        url = settings.kubelet_url.strip()
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"kubelet URL {url!r} is not a URL; e.g. https://$(NODE_IP):10250/pods")
        token_file: Path | None = None
        if settings.kubelet_token_file:
            token_file = Path(settings.kubelet_token_file)
        elif url.startswith("https://") and SERVICE_ACCOUNT_TOKEN.exists():
            token_file = SERVICE_ACCOUNT_TOKEN
        verify: bool | str = settings.kubelet_ca_file or True
        if settings.kubelet_insecure:
            verify = False
        try:
            targets = parse_targets(settings.scrape)
        except ConfigError as exc:
            raise ConfigError(f"WATTWATCH_SCRAPE (scrape in the config file): {exc}") from None
        try:
            targets += tuple(parse_target(spec) for spec in scrape)
        except ConfigError as exc:
            raise ConfigError(f"--scrape: {exc}") from None
        return cls(
            discover=settings.discover,
            proc_root=Path(settings.proc_root or "/proc"),
            kubelet_url=url,
            kubelet_token_file=token_file,
            kubelet_verify=verify,
            scrape=targets,
            fine_interval_s=settings.fine_interval_s,
            fine_tick_hold_s=settings.fine_tick_hold_s,
            poison_after=settings.poison_after,
        )
