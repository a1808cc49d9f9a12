import streamlit as st

st.title("estimate")
st.info("This page is not built yet.")
