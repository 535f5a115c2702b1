"""Every kcache command, as (path, command) pairs: what the CLI tests walk."""

import click


def commands(group: click.Group, prefix=()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, prefix + (name,))
        else:
            yield prefix + (name,), command
