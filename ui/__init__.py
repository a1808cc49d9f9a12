"""What the pages share: the routing guard, the job-following fragment, the Train page's run-config form and
panels. Streamlit lives here and in pages/, never in core/."""
