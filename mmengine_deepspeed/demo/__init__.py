"""The demo: a tiny character-level GPT trained on the Python standard library's source.

Importing this package registers its model, dataset, metric and progress hook, so the demo
config (``gpt_zero3.py`` beside this file) can name them.
"""
from .console import DemoProgressHook
from .data import StdlibText, stdlib_text, unigram_baseline
from .model import TinyGPT, ValLoss

__all__ = ['DemoProgressHook', 'StdlibText', 'TinyGPT', 'ValLoss', 'stdlib_text',
           'unigram_baseline']
