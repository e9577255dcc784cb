"""Tests of :mod:`mmseg_gf.accounting`. Most of its checks run a whole
step and sit with the layer that builds the model (engine, analysis):
``test_module_map.TESTS_OF`` lists, for each accounting module, the test
files that check it."""
