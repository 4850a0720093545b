"""LangChain adapter: ``ChatSGLang`` with grammar-enforced structured output and tools
(issue [7/9])."""
